"""A Hugging Face Llama built from a config, no weights downloaded, as pipeline stages of consecutive decoder layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

# transformers is imported where a Llama is built: importing it takes seconds of CPU, which every spawned rank of a
# benchmark that imports this module would pay for its other models too.
if TYPE_CHECKING:
    from transformers import LlamaConfig

# Each part draws its weights from its own seed, so that every split of the layers into stages holds the same model.
LAYER_SEED = 1000  # + the layer's index, as e2e.build_chunk seeds its GPT blocks
EMBEDDING_SEED = 1
HEAD_SEED = 2


def llama_config(hidden: int, layers: int, seq: int, vocab: int, **overrides) -> LlamaConfig:
    """A Llama of ``layers`` decoder layers: hidden // 128 heads (2 at least), half as many for keys and values, a 4x
    MLP, unless ``overrides`` (LlamaConfig's keywords) say otherwise. The attention is sdpa, which is causal when
    given no mask; with eager attention and no mask every position would see the whole sequence."""
    from transformers import LlamaConfig

    settings = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                    num_attention_heads=max(2, hidden // 128), num_key_value_heads=max(1, hidden // 256),
                    max_position_embeddings=seq, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                    attn_implementation="sdpa")
    return LlamaConfig(**(settings | overrides))


class LlamaStage(nn.Module):
    """Decoder layers ``layers`` of the Llama, with the embedding on the first stage (which takes token ids) and the
    final norm and LM head on the last (which returns logits); the others take and return hidden states.

    The parts are built one by one rather than cut out of a LlamaForCausalLM, which at d = 2048 would mean building
    half a billion parameters on every rank for every stage; so the weights keep PyTorch's default initialisation
    (LlamaForCausalLM's post_init would redraw them from N(0, 0.02)), which changes the loss's value, not the cost.
    Each stage computes the positions and rotary embeddings itself (they depend on the shape only), so that only the
    hidden states cross between stages (torch's PipelineStage sends a gradient back for every tensor it receives,
    which the position ids and a mask have none of). Construct it under ``with torch.device(device):`` to build the
    weights in place.
    """

    def __init__(self, config: LlamaConfig, layers: range, first: bool, last: bool):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        torch.manual_seed(EMBEDDING_SEED)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id) if first else None
        decoder_layers = []
        for index in layers:
            torch.manual_seed(LAYER_SEED + index)
            decoder_layers.append(LlamaDecoderLayer(config, index))
        self.layers = nn.ModuleList(decoder_layers)
        self.rotary = LlamaRotaryEmbedding(config)
        torch.manual_seed(HEAD_SEED)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else None
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            output = layer(hidden, position_ids=positions, position_embeddings=rotary)
            # transformers 5 returns the hidden states; 4.x a tuple (bootstrap.sh keeps a machine's own version).
            hidden = output[0] if isinstance(output, tuple) else output
        return self.head(self.norm(hidden)) if self.head is not None else hidden


def token_batch(sequences: int, seq: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next tokens as labels (int64), the same wherever drawn (a CPU generator)."""
    tokens = torch.randint(0, vocab, (sequences, seq + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
