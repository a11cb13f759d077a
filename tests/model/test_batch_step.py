"""Many sequences in one step (``Stage.forward_batch`` under the ``Scheduler``) against each
sequence run alone.

Eight sequences with prompts of 5 to 40 tokens arrive at different steps; a step holds at most
24 rows, so prompts are prefilled in chunks beside other sequences' decode rows. Each
sequence's greedy tokens must equal its run alone (``Engine.generate``), and the logits of
every drawn token must be within 1e-4 (float32) of the same position run alone. Seeded
sampling must draw the same tokens alone and in the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.errors import RequestError
from seamline.model.stage import Stage
from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.engine import Engine
from seamline.runtime.scheduler import Scheduler, SequenceState
from seamline.weights.loader import load_stage
from tests.support.configs import checkpoint_source

ATOL = 1e-4
ARRIVALS = (0, 0, 1, 2, 3, 5, 8, 13)  # the step at which each sequence is added
LENGTHS = (5, 40, 12, 33, 7, 21, 9, 28)  # its prompt length
NEW_TOKENS = 12


def _stage(kind: str, folder: Path) -> Stage:
    return load_stage(checkpoint_source(kind, folder))


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _run_batched(
    stage: Stage,
    prompts: list[list[int]],
    params: list[SamplingParams],
    prefill_chunk: int | None = None,
) -> list[tuple[SequenceState, list[torch.Tensor]]]:
    core = EngineCore.local(stage, context_length=512, max_step_tokens=24)
    scheduler = core.scheduler
    scheduler.prefill_chunk = prefill_chunk
    runs: list[tuple[SequenceState, list[torch.Tensor]]] = []
    step = 0
    while step <= max(ARRIVALS) or not scheduler.idle:
        for prompt, p, arrival in zip(prompts, params, ARRIVALS):
            if arrival == step:
                runs.append((scheduler.add(prompt, p), []))
        logits_of = {id(seq): logits for seq, logits in runs}
        for emission in core.step() or ():
            logits_of[id(emission.sequence)].append(emission.logits.float())
        step += 1
    return runs


def _alone_logits(stage: Stage, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits that drew each token, the sequence alone: prefill at once, then one step each."""
    cache = stage.new_cache()
    rows = [stage(torch.tensor(prompt), 0, cache, last_only=True)[-1]]
    for i, token in enumerate(tokens[:-1]):
        rows.append(stage(torch.tensor([token]), len(prompt) + i, cache)[-1])
    return torch.stack(rows).float()


def test_prompts_in_chunks_of_a_few_rows_draw_as_each_sequence_alone(tmp_path: Path) -> None:
    """A pipeline's stage 0 takes at most ``prefill_chunk`` rows of one prompt a step, so that the
    later stages compute a chunk while it computes the next: the tokens do not change."""
    stage = _stage("dense", tmp_path)
    prompts = _prompts(min(stage.config.vocab_size, 256))
    params = [SamplingParams(max_tokens=NEW_TOKENS)] * len(prompts)
    runs = _run_batched(stage, prompts, params, prefill_chunk=5)
    engine = Engine(stage, 512)
    for (sequence, logits), prompt in zip(runs, prompts):
        assert sequence.tokens == list(
            engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS))
        )
        assert len(logits) == NEW_TOKENS


def test_a_prompt_chunk_takes_at_most_prefill_chunk_rows(tmp_path: Path) -> None:
    stage = _stage("dense", tmp_path)
    core = EngineCore.local(stage, context_length=512, max_step_tokens=24)
    core.scheduler.prefill_chunk = 5
    sequence = core.scheduler.add(
        list(range(3, 43)), SamplingParams(max_tokens=1)
    )  # 40 prompt tokens
    steps = 0
    while not core.scheduler.idle:
        assert sequence.cached <= 5 * steps  # never more than 5 of its rows in one step
        core.step()
        steps += 1
    assert steps == 8  # 8 chunks of 5, the last drawing the one token


@pytest.mark.parametrize("kind", ["dense", "mixtral", "deepseek_v3", "embedded"])
def test_batched_greedy_equals_each_sequence_alone(kind: str, tmp_path: Path) -> None:
    stage = _stage(kind, tmp_path)
    prompts = _prompts(min(stage.config.vocab_size, 256))
    params = [SamplingParams(max_tokens=NEW_TOKENS)] * len(prompts)
    runs = _run_batched(stage, prompts, params)
    engine = Engine(stage, 512)
    for (sequence, logits), prompt in zip(runs, prompts):
        alone = list(engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS)))
        assert sequence.tokens == alone and sequence.finish_reason == "length"
        expected = _alone_logits(stage, prompt, alone)
        err = (torch.stack(logits) - expected).abs().max().item()
        assert err <= ATOL, f"sequence of {len(prompt)} tokens: max |batched - alone| = {err:.2e}"
        assert sequence.cache is None  # freed when it finished


def test_seeded_sampling_is_the_same_alone_and_batched(tmp_path: Path) -> None:
    stage = _stage("dense", tmp_path)
    prompts = _prompts(256)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=NEW_TOKENS)
        for i in range(len(prompts))
    ]
    runs = _run_batched(stage, prompts, params)
    engine = Engine(stage, 512)
    for (sequence, _), prompt, p in zip(runs, prompts, params):
        assert sequence.tokens == list(engine.generate(prompt, p))


def test_stop_token_and_context_end_finish_a_sequence(tmp_path: Path) -> None:
    stage = _stage("dense", tmp_path)
    prompt = _prompts(256)[0]
    first = list(Engine(stage, 512).generate(prompt, SamplingParams(max_tokens=3)))
    core = EngineCore.local(stage, context_length=len(prompt) + 2)
    scheduler = core.scheduler
    assert first[0] != first[1], "the stop token must not be the first token too"
    stopped = scheduler.add(prompt, SamplingParams(max_tokens=8, stop_token_ids=(first[1],)))
    cut = scheduler.add(prompt, SamplingParams(max_tokens=8))
    while not scheduler.idle:
        core.step()
    assert stopped.tokens == first[:1] and stopped.finish_reason == "stop"
    assert cut.tokens == first[:2] and cut.finish_reason == "length"  # the context is full
    assert stopped.cache is None and cut.cache is None


def _held(scheduler: Scheduler) -> int:
    """The bytes the running sequences' caches and the kept prefixes take, as allocated."""
    return (
        sum(s.cache.nbytes() for s in scheduler.running if s.cache is not None)
        + scheduler.prefix.held_bytes()
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_full_kv_budget_preempts_and_recomputes_without_changing_any_token(
    temperature: float, tmp_path: Path
) -> None:
    """A budget that holds every prompt's first buffer (256 positions) but not every cache grown
    past it: sequences are admitted as they fit now, the newest is preempted when the next step
    would not fit, and readmitted it recomputes its history; every sequence's tokens equal its
    run alone, and the memory the caches take never exceeds the budget. A request that could
    not fit even alone is refused and leaves nothing behind."""
    stage = _stage("dense", tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (250, 241, 246, 238)]
    new_tokens = 24  # each cache grows past 256 positions, to its prompt + max_tokens
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=new_tokens) for i in range(4)
    ]
    probe = Scheduler(stage, context_length=2048)
    budget = (
        4 * 256 + new_tokens
    ) * probe.kv_bytes_per_token  # every first buffer, one cache grown
    core = EngineCore.local(stage, context_length=2048, kv_budget_bytes=budget)
    scheduler = core.scheduler
    sequences = [scheduler.add(p, q) for p, q in zip(prompts, params)]
    core.step()
    assert scheduler.running == sequences  # every prompt fits now
    while not scheduler.idle:
        core.step()
        assert _held(scheduler) <= budget
    assert scheduler.preemptions > 0
    engine = Engine(stage, 2048)
    for sequence, prompt, q in zip(sequences, prompts, params):
        assert sequence.tokens == list(engine.generate(prompt, q)), sequence.id
    with pytest.raises(RequestError, match="MiB of KV cache"):
        scheduler.add(prompts[1], SamplingParams(max_tokens=budget // probe.kv_bytes_per_token))
    assert scheduler.idle  # the refused request left nothing behind


def test_many_short_sequences_hold_no_more_memory_than_the_budget(tmp_path: Path) -> None:
    """A cache's buffers start at 256 positions: counted by tokens, 40 sequences of ~20
    positions under a budget of 8 such sequences held 256-position buffers each, many times the
    budget. Counted as allocated (each cache bounded by its prompt + max_tokens), the memory
    held stays within the budget at every step, and every request still ends."""
    stage = _stage("dense", tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=gen).tolist()
        for n in torch.randint(6, 13, (40,), generator=gen)
    ]
    probe = Scheduler(stage, context_length=2048)
    budget = 8 * (12 + 8) * probe.kv_bytes_per_token
    core = EngineCore.local(stage, context_length=2048, kv_budget_bytes=budget)
    scheduler = core.scheduler
    sequences = [scheduler.add(p, SamplingParams(max_tokens=8)) for p in prompts]
    most = 0
    while not scheduler.idle:
        core.step()
        most = max(most, len(scheduler.running))
        assert _held(scheduler) <= budget
    assert most >= 8 and all(s.finish_reason in ("stop", "length") for s in sequences)


def test_a_shared_prompt_prefix_is_copied_not_recomputed(tmp_path: Path) -> None:
    """A second request whose prompt begins as a finished one's (kept in the prefix cache), and
    two identical prompts at once (the second waits for the first's prefill): they compute only
    what is new, and their logits and tokens equal runs without any sharing (float32, 1e-5)."""
    stage = _stage("dense", tmp_path)
    system = _prompts(256)[3]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    core = EngineCore.local(stage, context_length=512, prefix_cache_bytes=1 << 24)
    scheduler = core.scheduler
    first = scheduler.add(system + [5, 6], params)
    while not scheduler.idle:
        core.step()
    follow = scheduler.add(system + [9, 10, 11], params)
    twins = [scheduler.add(system + [7], params) for _ in range(2)]
    rows = []
    forward = stage.forward_batch
    stage.forward_batch = lambda inputs, spans, last_only=False: (
        rows.append(len(inputs)) or forward(inputs, spans, last_only)
    )  # type: ignore[method-assign]
    logits: dict[int, list[torch.Tensor]] = {}
    try:
        while not scheduler.idle:
            for emission in core.step() or ():
                logits.setdefault(emission.sequence.id, []).append(emission.logits)
    finally:
        del stage.forward_batch
    # computed: follow's 3 new prompt tokens, each twin's last prompt token, then the decodes
    assert sum(rows) == 3 + 1 + 1 + 3 * (NEW_TOKENS - 1), rows
    engine = Engine(stage, 512)
    for sequence in (first, follow, *twins):
        alone = list(engine.generate(sequence.prompt, params))
        assert sequence.tokens == alone
    for sequence in (follow, *twins):
        want = _alone_logits(stage, sequence.prompt, sequence.tokens)
        got = torch.stack(logits[sequence.id]).float()
        assert (got - want).abs().max().item() <= 1e-5


def test_a_seeded_sequence_replayed_from_its_history_goes_on_as_before(tmp_path: Path) -> None:
    """Prompt + the first tokens drawn, as a new prompt with the same seed: the rest follows as
    in the run that was not interrupted (what replay after a lost node relies on)."""
    stage = _stage("dense", tmp_path)
    prompt = _prompts(256)[3]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=NEW_TOKENS)
    engine = Engine(stage, 512)
    whole = list(engine.generate(prompt, params))
    resumed = list(
        engine.generate(
            prompt + whole[:5], SamplingParams(temperature=1.0, seed=5, max_tokens=NEW_TOKENS - 5)
        )
    )
    assert resumed == whole[5:]


def test_the_prefix_cache_bound_counts_the_buffers_its_caches_hold() -> None:
    """A 3-token prompt's cache holds buffers for 256 positions: the bound counts those, so the
    memory kept stays within it (counting tokens alone kept 85x more than the bound)."""
    from seamline.model.cache import SequenceCache
    from seamline.runtime.prefix_cache import PrefixCache

    def short_cache() -> SequenceCache:
        cache = SequenceCache(range(2))
        for layer in range(2):
            cache.layer(layer).update(torch.ones(2, 3, 8), torch.ones(2, 3, 8), 0)
        return cache

    one = short_cache().nbytes()
    released: list[SequenceCache] = []
    prefix = PrefixCache(10 * one, bytes_per_token=2 * 2 * 2 * 8 * 4, release=released.append)
    for i in range(50):
        prefix.put([i, i + 1, i + 2], short_cache(), 3)
    assert sum(cache.nbytes() for cache in prefix.caches()) <= 10 * one
    assert len(prefix.caches()) == 10 and len(released) == 40
