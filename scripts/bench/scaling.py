"""Scaling curves (issue 28 item 4): the cost of a rollout (W1 GRPO) and of a pair (W2 DPO) as one axis
grows, lit_rlhf against TRL.

    .venv/bin/python scripts/bench/scaling.py --trl-python .bench-venv/bin/python --out scaling.json
        [--size full|smoke] [--axes prompt_len,k,model,vocab] [--algos grpo,dpo] [--repeats 1]
        [--responses fixed|eos]
    .venv/bin/python scripts/bench/scaling_plot.py scaling.json --out-dir docs/scaling

Every point is the W1 GRPO workload (grpo_bench.py) or the W2 DPO workload (pair_bench.py --algo dpo) with
one setting moved away from the base point (``BASE``): the prompt length (every prompt exactly that many
tokens), K (responses per prompt), the model (hidden size and layers of the Llama actor) or the vocabulary
(a byte-level BPE trained to exactly that many tokens, and the actor's embedding and LM head to match).
Everything else is W1's / W2's (workloads.py): responses sampled at temperature 1 with <= 64 new tokens, the
same loss settings; DPO pairs have a chosen and a rejected response of ``PAIR_RESPONSE`` tokens each.
``--responses fixed`` (the default) gives EOS probability 0 in the actor's weights (:func:`never_eos`), so
every response is 64 tokens and every rollout of a point does the same work for both libraries; ``eos``
keeps W1's EOS-stopped responses (EOS probability 1/32, mean ~27 tokens, ``workloads.calibrate_eos``),
where a rollout's time follows its sampled lengths (the decoding runs to the longest of the K), which at a
few timed rollouts per point swamps the axis being varied at small K.

Per point, lit_rlhf and the TRL release of ``--trl-python`` run in their own processes, one after the
other, the order alternating from point to point (lit, trl; trl, lit; ...). A GRPO run does one warm-up
rollout and ``rollouts`` timed ones; a DPO run one warm-up step and ``dpo_steps`` timed ones of W2's 2
pairs each (``workloads.SIZES["full"]``). A run that fails (out of memory, a timeout) is recorded with its
error, never dropped. ``--out`` writes every raw
result with the CPU model and the package versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import log  # noqa: E402
from workloads import SIZES  # noqa: E402

# The Llama actors of the model axis (vocab 32k): "20M" is W1's actor (16.4M of its 20.6M parameters are
# the embedding and the LM head), "5M" is nearly all embedding and head, "100M" two thirds transformer layers.
MODELS = {
    "5M": dict(hidden_size=72, intermediate_size=288, num_hidden_layers=4, num_attention_heads=2),
    "20M": SIZES["full"]["model"],
    "100M": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8),
    # --size smoke: the harness end to end in a few minutes, not for figures
    "smoke-1": SIZES["smoke"]["model"],
    "smoke-2": {**SIZES["smoke"]["model"], "num_hidden_layers": 2},
}
NOMINAL_PARAMS = {"5M": 5e6, "20M": 20e6, "100M": 100e6}  # at vocab 32k (checked by the tests)

SWEEPS = {
    "full": dict(
        base=dict(prompt_len=256, k=8, model="20M", vocab=32000),
        axes=dict(prompt_len=(64, 256, 1024), k=(2, 4, 8, 16), model=("5M", "20M", "100M"),
                  vocab=(8000, 32000, 128000)),
        rollouts=2,  # timed rollouts per GRPO run, after one warm-up
        dpo_steps=3,  # timed steps per DPO run, after one warm-up
    ),
    "smoke": dict(
        base=dict(prompt_len=32, k=2, model="smoke-1", vocab=1000),
        axes=dict(prompt_len=(16, 32), k=(2, 4), model=("smoke-1", "smoke-2"), vocab=(1000, 2000)),
        rollouts=1,
        dpo_steps=1,
    ),
}  # fmt: skip
AXIS_LABELS = dict(prompt_len="prompt length (tokens)", k="K (responses per prompt)",
                   model="actor parameters", vocab="vocabulary (tokens)")  # fmt: skip
ALGO_AXES = dict(grpo=("prompt_len", "k", "model", "vocab"), dpo=("prompt_len", "model", "vocab"))
PAIR_RESPONSE = 64  # tokens of each chosen / rejected response of a DPO pair, EOS included
# Words drawn for the lexicon of a vocabulary: 60,000 draws (~43k words) merge to 32,000 tokens on their
# own (workloads.lexicon, W1's tokenizer); 128,000 tokens need ~177k words.
LEXICON_DRAWS = {128000: 300000}


def point_name(point: dict) -> str:
    return f"L{point['prompt_len']}_K{point['k']}_{point['model']}_V{point['vocab']}"


def points(size: str, axes: tuple[str, ...], algo: str) -> list[dict]:
    """The distinct points of ``algo``'s sweeps over ``axes`` (the base point once); DPO has no K, so its
    points keep the base K (unused) and skip the K axis."""
    sweep = SWEEPS[size]
    out = {}
    for axis in axes:
        if axis not in ALGO_AXES[algo]:
            continue
        for value in sweep["axes"][axis]:
            point = {**sweep["base"], axis: value}
            out.setdefault(point_name(point), point)
    return list(out.values())


def model_fields(point: dict, special: dict) -> dict:
    """LlamaConfig fields of ``point``'s actor (untied embeddings, room for 1,024 + 64 positions)."""
    return dict(**MODELS[point["model"]], vocab_size=point["vocab"], max_position_embeddings=2048,
                tie_word_embeddings=False, **special)  # fmt: skip


def lexicon(vocab: int) -> list[str]:
    """workloads.lexicon with enough words for ``vocab`` (W1's own at 32k and below)."""
    import random

    from workloads import _SYLLABLES

    draws = LEXICON_DRAWS.get(vocab, 60000)
    rng, syllables = random.Random(0), _SYLLABLES.split()
    return sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))) for _ in range(draws)})


def vocabulary(vocab: int) -> tuple:
    """(words, tokenizer, word -> ids) of a byte-level BPE with exactly ``vocab`` tokens."""
    from workloads import training_texts

    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    words = lexicon(vocab)
    tok = train_bpe_tokenizer(training_texts(words), vocab_size=vocab)
    assert len(tok) == vocab, f"tokenizer has {len(tok)} tokens, not {vocab}"
    return words, tok, dict(zip(words, tok([" " + w for w in words])["input_ids"]))


def point_data(point: dict, size: str, words: list[str], tok, word_ids: dict) -> dict:
    """GRPO prompts of exactly ``prompt_len`` tokens; DPO pairs of such a prompt and a chosen and a
    rejected response of ``PAIR_RESPONSE`` tokens each (EOS included)."""
    import random

    from workloads import sample_text

    rng, sweep = random.Random(1), SWEEPS[size]

    def text(n: int) -> dict:
        t, ids = sample_text(rng, words, word_ids, n, n)
        assert len(ids) == n and tok(t)["input_ids"] == ids, "a text does not tokenize to its ids"
        return dict(text=t, ids=ids)

    prompts = [text(point["prompt_len"]) for _ in range(sweep["rollouts"] + 1)]
    pairs = []
    for _ in range(SIZES["full"]["dpo_pairs_per_step"] * (sweep["dpo_steps"] + 1)):
        pair = dict(
            prompt=text(point["prompt_len"]), chosen=text(PAIR_RESPONSE - 1), rejected=text(PAIR_RESPONSE - 1)
        )
        for slot in ("chosen", "rejected"):
            pair[slot]["ids"] = pair[slot]["ids"] + [tok.eos_token_id]
        pairs.append(pair)
    return dict(grpo_prompts=prompts, pairs=pairs)


def never_eos(actor, eos: int) -> None:
    """After ``workloads.calibrate_eos``: the LM head gives EOS a logit of about -300 at every position
    (it reads the constant hidden dimension 0, ~1.5 after the final norm, with weight -200), so EOS has
    probability 0 in float32 and every response runs to ``MAX_NEW_TOKENS``. In the weights, so neither
    library needs a logits processor for it."""
    import torch

    with torch.no_grad():
        actor.get_output_embeddings().weight[eos, 0] = -200.0


def build(root: Path, size: str, todo: list[dict], responses: str) -> None:
    """Assets of every point (``root/<point_name>/actor`` and ``data.json``), in lit_rlhf's environment:
    a tokenizer per vocabulary (:func:`vocabulary`), the data (:func:`point_data`) and the EOS-calibrated
    random-init actor (``workloads.calibrate_eos``; with ``responses="fixed"`` also :func:`never_eos`)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    from workloads import calibrate_eos

    hf_logging.disable_progress_bar()
    vocabs = {}
    for point in todo:
        out = root / point_name(point)
        if (out / "data.json").exists():
            continue
        if point["vocab"] not in vocabs:
            vocabs[point["vocab"]] = vocabulary(point["vocab"])
        tok = vocabs[point["vocab"]][1]
        data = point_data(point, size, *vocabs[point["vocab"]])
        special = dict(
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id
        )
        torch.manual_seed(0)
        actor = LlamaForCausalLM(LlamaConfig(**model_fields(point, special)))
        calibrate_eos(actor, tok.eos_token_id, [p["ids"] for p in data["grpo_prompts"]])
        if responses == "fixed":
            never_eos(actor, tok.eos_token_id)
        actor.generation_config = GenerationConfig(suppress_tokens=[tok.pad_token_id], **special)
        actor.save_pretrained(out / "actor")
        tok.save_pretrained(out / "actor")
        (out / "data.json").write_text(json.dumps(data))
        log(
            f"  built {point_name(point)}: {sum(p.numel() for p in actor.parameters()) / 1e6:.1f}M parameters"
        )


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run_point(runner, algo: str, point: dict, impl: str, sweep: dict, folder: Path) -> dict:
    """One run of ``impl`` at ``point``: its BENCH_RESULT, or ``{"error": ...}`` if it failed."""
    if algo == "grpo":
        script = "grpo_bench.py"
        extra = ("--k", str(point["k"]), "--rollouts", str(sweep["rollouts"] + 1))
    else:
        script = "pair_bench.py"
        extra = ("--algo", "dpo", "--steps", str(sweep["dpo_steps"]))
    try:
        return runner.run(script, impl, "--size", "full", "--folder", str(folder), *extra)
    except SystemExit as err:  # compare.Runner logs the run's output tail
        return dict(impl=impl, error=str(err))


def versions(runs: dict) -> dict[str, dict[str, str]]:
    """The package versions of each implementation, from its first run that finished."""
    out = {}
    for algo_points in runs.values():
        for entry in algo_points.values():
            for rep in entry["runs"]:
                for impl, run in rep.items():
                    if "versions" in run:
                        out.setdefault(impl, run["versions"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trl-python", required=True, help="the TRL environment's python (.bench-venv/bin/python)"
    )
    parser.add_argument("--size", choices=sorted(SWEEPS), default="full")
    parser.add_argument("--axes", default="prompt_len,k,model,vocab")
    parser.add_argument("--algos", default="grpo,dpo")
    parser.add_argument(
        "--assets", default=".bench-assets/scaling", help="where the points' assets are built"
    )
    parser.add_argument(
        "--responses", choices=["fixed", "eos"], default="fixed",
        help="fixed: every response 64 tokens (EOS never sampled); eos: W1's EOS-stopped responses (mean ~27)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each implementation per point")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.trl_new_python = None
    import subprocess

    from common import child_env
    from compare import Runner

    sweep, axes = SWEEPS[args.size], tuple(args.axes.split(","))
    root = Path(args.assets).resolve() / f"{args.size}_{args.responses}"
    todo = {algo: points(args.size, axes, algo) for algo in args.algos.split(",")}
    unique = list({point_name(p): p for ps in todo.values() for p in ps}.values())
    build_args = json.dumps([str(root), args.size, unique, args.responses])
    subprocess.run([sys.executable, __file__, "--build", build_args], check=True, env=child_env(args.threads))
    runner = Runner(args, Path.cwd())
    result = dict(cpu=cpu_model(), threads=args.threads, size=args.size, responses=args.responses, sweep=sweep, models=MODELS,
                  pair_response=PAIR_RESPONSE, runs={})  # fmt: skip
    turn, start = 0, time.perf_counter()
    for algo, algo_points in todo.items():
        for point in algo_points:
            for _ in range(args.repeats):
                order = ["lit", "trl"] if turn % 2 == 0 else ["trl", "lit"]
                turn += 1
                runs = {
                    impl: run_point(runner, algo, point, impl, sweep, root / point_name(point))
                    for impl in order
                }
                result["runs"].setdefault(algo, {}).setdefault(point_name(point), dict(point=point, runs=[]))
                result["runs"][algo][point_name(point)]["runs"].append(runs)
                Path(args.out).write_text(json.dumps(result, indent=1))  # partial results survive a crash
            log(f"{algo} {point_name(point)} done, {time.perf_counter() - start:.0f} s so far")
    result["versions"] = versions(result["runs"])
    log(
        f"CPU {result['cpu']}, {args.threads} thread(s); "
        + "; ".join(
            f"{impl}: " + ", ".join(f"{k} {v}" for k, v in vers.items())
            for impl, vers in result["versions"].items()
        )
    )
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        root, size, todo, responses = json.loads(sys.argv[2])
        import torch

        torch.set_num_threads(1)
        build(Path(root), size, todo, responses)
    else:
        main()
