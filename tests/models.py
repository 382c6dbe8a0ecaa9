"""Small modules the pipeline and partition tests both build their models from."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64  # of the tiny language models
HIDDEN = 8  # of the exactness and recomputation tests' blocks


class Block(nn.Module):
    """A pre-norm residual block with a Linear (whose weight gradient zero-bubble schedules defer)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class MaskedBlock(nn.Module):
    """A transformer-like residual MLP block that also carries a bool mask across the stage boundary."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x, mask):
        update = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + update * mask.unsqueeze(-1), mask


def gpt2(num_stages: int, layers: int = 4):
    """A tiny transformers GPT-2 (tied embedding and LM head, no dropout), annotated on its own submodules."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=layers, n_head=2, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.transformer.wte.pipeline_stage = model.transformer.wpe.pipeline_stage = 0
    for index, block in enumerate(model.transformer.h):
        block.pipeline_stage = index * num_stages // layers
    model.transformer.ln_f.pipeline_stage = model.lm_head.pipeline_stage = num_stages - 1
    return model


def bart(num_stages: int):
    """A tiny transformers BART with dropout, annotated on its layers: the encoder's and decoder's own forwards,
    which apply ``F.dropout(h, p, self.training)`` to the embeddings, are functional code between the stages."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=40,
                        dropout=0.3, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    model = BartForConditionalGeneration(config)
    encoder, decoder = model.model.encoder, model.model.decoder
    for part in (encoder.embed_tokens, encoder.embed_positions, encoder.layernorm_embedding, *encoder.layers):
        part.pipeline_stage = 0
    for part in (decoder.embed_tokens, decoder.embed_positions, decoder.layernorm_embedding, *decoder.layers,
                 model.lm_head):
        part.pipeline_stage = num_stages - 1
    return model


class EmbeddingDropoutLM(nn.Module):
    """A small language model whose own forward drops out its embeddings by its training flag, as BART's and
    Whisper's do: functional code between the stages that changes with ``model.eval()``."""

    def __init__(self, num_stages: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2 * num_stages))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.embed.pipeline_stage, self.head.pipeline_stage = 0, num_stages - 1
        for index, block in enumerate(self.blocks):
            block.pipeline_stage = index // 2

    def forward(self, tokens):
        h = nn.functional.dropout(self.embed(tokens), 0.3, self.training)
        for block in self.blocks:
            h = block(h)
        return self.head(nn.functional.dropout(h, 0.1, self.training))


def llama(num_stages: int, layers: int = 4):
    """A tiny transformers Llama (rotary embeddings, grouped-query attention), annotated on its own submodules."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.model.embed_tokens.pipeline_stage = 0
    for index, block in enumerate(model.model.layers):
        block.pipeline_stage = index * num_stages // layers
    model.model.norm.pipeline_stage = model.lm_head.pipeline_stage = num_stages - 1
    return model



class ResidualCNN(nn.Module):
    """A ResNet-like CNN whose forward calls functional ops between its children: relu, a residual add, flatten."""

    def __init__(self, channels: int = 4, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels * 16, classes)

    def forward(self, images):
        x = torch.nn.functional.relu(self.stem(images))
        skip = x
        x = torch.nn.functional.relu(self.conv1(x))
        x = self.conv2(x) + skip
        x = torch.nn.functional.adaptive_avg_pool2d(torch.relu(x), 4)
        return self.head(torch.flatten(x, 1))


class LongSkip(nn.Module):
    """Four linear blocks; the first one's output is added back after the last, three stages later."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(4))
        for index, block in enumerate(self.blocks):
            block.pipeline_stage = index

    def forward(self, x):
        first = torch.tanh(self.blocks[0](x))
        h = first
        for block in self.blocks[1:]:
            h = torch.tanh(block(h))
        return h + first


# Tiny decoder-only configurations of architectures beyond GPT-2 and Llama: sliding windows, biases,
# ALiBi, parallel attention, per-head norms and mixtures of experts.
CAUSAL_LMS = {
    "qwen2": ("Qwen2", dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)),
    "mistral": ("Mistral", dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, sliding_window=4)),
    "gemma2": ("Gemma2", dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              sliding_window=4)),
    "phi3": ("Phi3", dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, resid_pdrop=0.0,
                          embd_pdrop=0.0)),
    "gpt_neox": ("GPTNeoX", dict(intermediate_size=32, num_attention_heads=2, hidden_dropout=0.0)),
    "opt": ("OPT", dict(ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16, dropout=0.0)),
    "bloom": ("Bloom", dict(n_head=2, hidden_dropout=0.0)),
    "falcon": ("Falcon", dict(num_attention_heads=2, hidden_dropout=0.0, new_decoder_architecture=False, alibi=False)),
    "mixtral": ("Mixtral", dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                num_local_experts=4, num_experts_per_tok=2)),
}


def causal_lm(name: str, num_stages: int, layers: int = 4, **overrides):
    """A tiny transformers model of CAUSAL_LMS, annotated as a user would: the blocks spread evenly, and
    around them, at every level, what runs before (embeddings) on stage 0 and what runs after (final norm,
    LM head) on the last stage."""
    import transformers

    prefix, settings = CAUSAL_LMS[name]
    config = getattr(transformers, prefix + "Config")(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers, max_position_embeddings=64, use_cache=False,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0, **{**settings, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(config)
    path, blocks = max(((path, module) for path, module in model.named_modules() if isinstance(module, nn.ModuleList)),
                       key=lambda item: len(item[1]))
    # Registration order is not run order (OPT registers its final norm before its blocks): run it once.
    order: dict[nn.Module, int] = {}

    def note_order(module: nn.Module, args) -> None:
        order.setdefault(module, len(order))

    hooks = [module.register_forward_pre_hook(note_order) for module in model.modules()]
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long))
    for hook in hooks:
        hook.remove()

    def first_run(module: nn.Module) -> int | None:  # a container may never be called itself (OPT's)
        return min((order[inner] for inner in module.modules() if inner in order), default=None)

    holder = model
    for part in path.split("."):
        on_path = getattr(holder, part)
        for child in holder.children():
            # A rotary embedding (buffers only) is left to run where its output is used.
            if child is not on_path and first_run(child) is not None and any(True for _ in child.parameters()):
                child.pipeline_stage = 0 if first_run(child) < first_run(on_path) else num_stages - 1
        holder = on_path
    for index, block in enumerate(blocks):
        block.pipeline_stage = index * num_stages // len(blocks)
    return model
