"""One stage of a GPT-2 split by capture against the same layers split by hand: forward + backward time, one GPU."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, print_environment, print_table, time_on, write_json  # noqa: E402

import pipecomm  # noqa: E402


class HandStage(nn.Module):
    """The last stage written by hand: the same blocks, final norm and head, called with the same arguments."""

    def __init__(self, model: GPT2LMHeadModel, blocks: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(model.transformer.h[index] for index in blocks)
        self.ln_f = model.transformer.ln_f
        self.lm_head = model.lm_head

    def forward(self, hidden, mask, position_ids):
        for block in self.blocks:
            hidden = block(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                           position_ids=position_ids)
        return self.lm_head(self.ln_f(hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two timings")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI checks the control flow)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.batch, args.seq, args.rounds = 32, 2, 2, 16, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    env = environment(device)
    print_environment(env)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8192, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                        n_head=max(1, args.hidden // 64), use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    half = args.layers // 2
    model.transformer.wte.pipeline_stage = model.transformer.wpe.pipeline_stage = 0
    for index, block in enumerate(model.transformer.h):
        block.pipeline_stage = int(index >= half)
    model.transformer.ln_f.pipeline_stage = model.lm_head.pipeline_stage = 1
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    first, last = pipecomm.split(model, 2, [0, 1], example_inputs=(tokens.cpu()[:2],), device=device)
    hand = HandStage(model, list(range(half, args.layers)))
    received = first(tokens)
    hidden_index = first.boundary_names.index(f"transformer_h_{half - 1}")
    mask = next(value for value in received if isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    position_ids = next(value for value in received if isinstance(value, torch.Tensor)
                        and value.dtype == torch.int64)
    hidden = received[hidden_index].detach().requires_grad_()
    captured_inputs = tuple(hidden if index == hidden_index else value for index, value in enumerate(received))

    def captured():
        last(*captured_inputs).logits.float().square().mean().backward()

    def by_hand():
        hand(hidden, mask, position_ids).float().square().mean().backward()

    torch.testing.assert_close(last(*captured_inputs).logits, hand(hidden, mask, position_ids))
    samples = {"captured": [], "by hand": []}
    for _ in range(args.rounds):
        for name, fn in (("captured", captured), ("by hand", by_hand)):
            samples[name].append(time_on(device, fn, warmup=3, iters=20))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = [{"stage": name, "fwd+bwd ms": medians[name], "ratio": medians[name] / medians["by hand"]}
            for name in ("captured", "by hand")]
    print_table(rows, ["stage", "fwd+bwd ms", "ratio"])
    if args.json:
        write_json(args.json, {"environment": env, "shape": vars(args), "samples_ms": samples, "rows": rows})


if __name__ == "__main__":
    main()
