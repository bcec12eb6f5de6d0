"""Multi-turn chat: session pinning vs prefix caching vs no caching, in-process with ``LLM``.

Part 1: one chat, a ~512-token system prompt and 8 turns of ~40 tokens each
way (``ChatFormatter``, greedy, ``ignore_eos`` so answers are exactly
``--answer-tokens``), run three ways on fresh engines sharing one loaded
model: ``pinning`` (session ids), ``prefix`` (prefix caching, no sessions),
``none`` (``enable_prefix_caching=False``). Per turn: prompt tokens computed
(delta of ``scheduler.counters.computed_prompt_tokens``) and TTFT.

Part 2: M sessions sharing one system prompt: physical blocks holding the
shared prefix vs logical references (block-table entries summed over the
sessions' pins), when the M first turns arrive together and staggered.

    python -m load_tests.bench_multiturn                 # SmolLM2-135M
    python -m load_tests.bench_multiturn --model tiny    # smoke
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import WORDS, add_model_args, goal, load, make_parser, print_header, table, write_json
from load_tests.plots import plot_ttft_by_turn

MODES = ("pinning", "prefix", "none")


def text_of_tokens(tokenizer: Any, rng: random.Random, n: int) -> str:
    """Plain text of about ``n`` tokens (random common words, cut at the token count)."""
    ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(2 * n + 8)), add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:n]).strip()


def conversation(llm: Any, chat: Any, system: str, users: list[str], params: Any, pin: bool) -> list[dict[str, Any]]:
    core = llm.core
    eos = set(core.loaded.eos_token_ids)
    rows: list[dict[str, Any]] = []
    history: list[int] = []
    for turn, user in enumerate(users):
        if turn == 0:
            appended = chat.first_turn(user, system)
            prompt = appended
        else:
            appended = chat.next_turn(user, history[-1] in eos)
            prompt = history + appended
        c0 = core.scheduler.counters.computed_prompt_tokens
        t0 = time.perf_counter()
        (res,) = llm.generate([prompt], params, session_ids=["chat"] if pin else None)
        wall = time.perf_counter() - t0
        out = res.outputs[0].token_ids
        rows.append({"turn": turn + 1, "prompt_tokens": len(prompt), "appended_tokens": len(appended),
                     "computed": core.scheduler.counters.computed_prompt_tokens - c0, "ttft_ms": 1e3 * res.ttft_s,
                     "cached_tokens": res.usage.cached_tokens, "output_tokens": len(out), "wall_s": wall})  # fmt: skip
        history = prompt + out
    if pin:
        core.release_session("chat")
    core.check_invariants()
    return rows


def shared_prefix_blocks(llm_factory: Any, chat: Any, system: str, users: list[str], params: Any, staggered: bool
                         ) -> list[Any]:  # fmt: skip
    """Run M first turns (sessions s0..), then count blocks covering the common prefix of their prompts."""
    llm = llm_factory(True, 1.0)  # every session keeps its pin (the default 0.5 would unpin the oldest)
    prompts = [chat.first_turn(u, system) for u in users]
    sids = [f"s{i}" for i in range(len(users))]
    if staggered:
        llm.generate(prompts[:1], params, session_ids=sids[:1])
        llm.generate(prompts[1:], params, session_ids=sids[1:])
    else:
        llm.generate(prompts, params, session_ids=sids)
    common = 0
    while all(len(p) > common for p in prompts) and len({p[common] for p in prompts}) == 1:
        common += 1
    kv = llm.core.kv
    bs = kv.block_size
    n_cover = -(-common // bs)
    table_entries = [b for sid in sids for b in kv.sessions[sid].blocks[:n_cover]]
    physical = {b.block_id: b.ref_cnt for b in table_entries}
    ideal = common // bs + (len(users) if common % bs else 0)
    for sid in sids:
        llm.core.release_session(sid)
    llm.core.check_invariants()
    return ["staggered (1, then M-1)" if staggered else "together", len(users), common, len(table_entries),
            len(physical), ideal, max(physical.values())]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=40)
    p.add_argument("--answer-tokens", type=int, default=40)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--sessions", type=int, default=8, help="part 2: sessions sharing the system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results (the TTFT plot goes next to it as .png)")
    a = p.parse_args(argv)
    loaded = load(a.model, a.threads)
    header = print_header("bench_multiturn: session pinning vs prefix caching vs none", "load_tests.bench_multiturn")
    from streamkv.llm import LLM
    from streamkv.model.chat import ChatFormatter
    from streamkv.sampling_params import SamplingParams

    tok = loaded.tokenizer
    rng = random.Random(a.seed)
    chat = ChatFormatter(tok)
    system = text_of_tokens(tok, rng, a.system_tokens)
    users = [text_of_tokens(tok, rng, a.user_tokens) for _ in range(a.turns)]
    params = SamplingParams(temperature=0.0, max_tokens=a.answer_tokens, ignore_eos=True)

    def make(caching: bool = True, pinned_fraction: float = 0.5) -> LLM:
        return LLM(loaded=loaded, device="cpu", num_blocks=a.num_blocks, enable_prefix_caching=caching,
                   max_pinned_fraction=pinned_fraction)  # fmt: skip

    make().generate([chat.first_turn(users[0], system)], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    results: dict[str, list[dict[str, Any]]] = {}
    for mode in MODES:
        results[mode] = conversation(make(mode != "none"), chat, system, users, params, pin=mode == "pinning")
    cols = ["turn", "prompt tokens", "appended"] + [f"{m} computed" for m in MODES] + [f"{m} TTFT ms" for m in MODES]
    pin, none = results["pinning"], results["none"]
    rows = [[pin[i]["turn"], pin[i]["prompt_tokens"], pin[i]["appended_tokens"]]
            + [results[m][i]["computed"] for m in MODES] + [results[m][i]["ttft_ms"] for m in MODES]
            for i in range(a.turns)]  # fmt: skip
    print(table(cols, rows))
    ratio = none[-1]["ttft_ms"] / pin[-1]["ttft_ms"]
    later = pin[1:]
    extra = [r["computed"] - r["appended_tokens"] for r in later]
    # The previous answer's last token was sampled but never run through the model: its KV is
    # missing from the pin, so it is new to the cache (as in vLLM) and computed with the turn.
    only_new = all(x == 1 for x in extra)
    goals = [
        goal(f"turn-{a.turns} TTFT: pinning >= 5x lower than no caching", ratio >= 5.0, f"{ratio:.1f}x"),
        goal("pinning: after turn 1 only new tokens are computed (appended turn + the previous answer's "
             "last sampled token, whose KV no step wrote)", only_new,
             f"computed - appended per turn: {extra}; strictly 'appended alone' "
             f"{'holds' if all(x == 0 for x in extra) else 'does not hold'}"),
    ]  # fmt: skip
    print("\npart 2: sessions sharing one system prompt (blocks covering the common prefix of their first prompts)")
    firsts = [text_of_tokens(tok, rng, a.user_tokens) for _ in range(a.sessions)]
    short = SamplingParams(temperature=0.0, max_tokens=4)
    part2 = [shared_prefix_blocks(make, chat, system, firsts, short, staggered) for staggered in (False, True)]
    cols2 = ["arrival", "sessions", "common prefix tokens", "logical refs", "physical blocks",
             "ideal physical", "max ref_cnt"]  # fmt: skip
    print(table(cols2, part2))
    if a.out:
        out = Path(a.out)
        write_json(out, {**header, "args": vars(a), "turns": results, "goals": goals,
                         "sharing": [dict(zip(cols2, r, strict=True)) for r in part2]})  # fmt: skip
        title = f"TTFT by turn ({loaded.name}, {a.system_tokens}-token system prompt)"
        plot_ttft_by_turn(results, out.with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
