"""train_step / sft_step on the real tiny model: split invariance, REINFORCE at r = 1, metrics, clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from gyre.config.trainer import LossConfig, OptimConfig
from gyre_orchestrator.packing import TrainSample, pack_batch
from gyre_trainer.model import packed_logprobs
from gyre_trainer.optim import build_optimizer, build_scheduler
from gyre_trainer.step import (
    compute_gradients,
    compute_sft_gradients,
    data_parallel_scale,
    optimizer_step,
    sft_step,
    train_step,
)
from trainer_core_lib import dp_worker, flat_grad, make_batch, random_samples, set_behaviour_logprobs

LENGTHS = [9, 14, 6, 11, 8, 13, 7, 10]
LAYOUTS = {
    "1 micro-batch": [[list(range(8))]],
    "2 micro-batches": [[[0, 1, 2, 3], [4, 5, 6, 7]]],
    "4 micro-batches": [[[0, 1], [2, 3], [4, 5], [6, 7]]],
    "8 single-sample rows": [[[i] for i in range(8)]],
}


@pytest.fixture
def samples(tiny_llama64):
    rng = np.random.default_rng(0)
    samples = random_samples(rng, LENGTHS)
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.3, rng=rng)  # a mix of clipped and unclipped tokens
    return samples


def gradient(model, batch, loss_cfg, **kwargs) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    compute_gradients(model, batch, loss_cfg=loss_cfg, **kwargs)
    return flat_grad(model).clone()


def assert_same_gradient(got: torch.Tensor, want: torch.Tensor) -> None:
    assert want.norm() > 0
    # Relative to the gradient's scale: behaviour log-probs travel as float32 (the batch schema), so
    # "r = 1" is 1 ± 1e-7 and elements that nearly cancel carry that much absolute noise.
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize(
    "loss_cfg",
    [
        LossConfig(type="ppo_clip", aggregation="token-mean"),
        LossConfig(type="gspo", aggregation="seq-mean-token-mean", eps_low=0.05, eps_high=0.05),
        LossConfig(type="masked_is", aggregation="seq-mean-token-sum-norm", sequence_mask=True, mask_high=1.2),
        LossConfig(type="cispo", aggregation="token-mean", kl_tau=0.1),
        # dual-clip at c = 1.1 (noise 0.3 puts many A < 0 tokens above it), the new aggregations,
        # and every off-policy correction (sequence ones at caps the noisy samples cross)
        LossConfig(type="ppo_clip", aggregation="seq-mean-token-sum", clip_ratio_c=1.1),
        LossConfig(type="aipo", aggregation="token-sum", delta=1.5, is_correction="token_tis", is_cap=1.3),
        LossConfig(type="gspo", is_correction="seq_tis", is_cap=2.0, is_cap_low=0.5),
        LossConfig(type="ppo_clip", is_correction="token_mask", is_cap=1.5, is_cap_low=0.7),
        LossConfig(type="cispo", aggregation="seq-mean-token-sum-norm", is_correction="seq_mask", is_cap=2.0),
        # the entropy bonus: its gradient flows through the chunked log-prob kernel, aggregated like the loss
        LossConfig(type="ppo_clip", aggregation="seq-mean-token-mean", entropy_coeff=0.05),
    ],
    ids=lambda c: f"{c.type}-{c.aggregation}-{c.is_correction}",
)
def test_splitting_the_batch_does_not_change_the_gradient(tiny_llama64, samples, loss_cfg):
    reference = gradient(tiny_llama64, make_batch(samples, LAYOUTS["1 micro-batch"]), loss_cfg)
    # micro_batch_size > 1 stacks rows of unequal length into one forward, padding the short ones.
    for name, micro_batch_size in (
        ("2 micro-batches", 1),
        ("4 micro-batches", 1),
        ("4 micro-batches", 2),
        ("8 single-sample rows", 3),
    ):
        got = gradient(tiny_llama64, make_batch(samples, LAYOUTS[name]), loss_cfg, micro_batch_size=micro_batch_size)
        assert_same_gradient(got, reference)
    # Two data-parallel ranks, each scaled by data_parallel_scale(2), averaged as FSDP2 averages.
    two_ranks = make_batch(samples, [[[0, 1, 2], [3]], [[4, 5], [6, 7]]])
    shares = [gradient(tiny_llama64, two_ranks, loss_cfg, rank=r, world_size=2) for r in (0, 1)]
    assert data_parallel_scale(2) == 2.0
    assert_same_gradient((shares[0] + shares[1]) / 2, reference)


@pytest.mark.parametrize("how", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_splitting_the_batch_does_not_change_the_reference_kl_gradient(tiny_model, tiny_llama64, samples, how,
                                                                       estimator):  # fmt: skip
    """The KL to a frozen reference is aggregated with the objective, by the batch's global counts: its gradient and
    its `ref_kl` metric are the same whatever the micro-batches, padding and ranks."""
    from gyre.config.trainer import ModelConfig
    from gyre_trainer.model import load_model

    reference = load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64).requires_grad_(False)
    with torch.no_grad():  # another policy than the trained one: the KL and its gradient are not 0
        for param in reference.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel()),
                                   dtype=param.dtype), alpha=0.02)  # fmt: skip
    cfg = LossConfig(type="cispo", aggregation=how, ref_kl_coef=0.5, ref_kl_estimator=estimator)

    def grad_and_kl(layout, **kwargs):
        tiny_llama64.zero_grad(set_to_none=True)
        metrics = compute_gradients(tiny_llama64, make_batch(samples, layout), loss_cfg=cfg, ref_model=reference,
                                    **kwargs)  # fmt: skip
        return flat_grad(tiny_llama64).clone(), metrics["ref_kl"]

    want, kl = grad_and_kl(LAYOUTS["1 micro-batch"])
    assert abs(kl) > 1e-4
    for name, micro_batch_size in (("4 micro-batches", 1), ("8 single-sample rows", 3)):
        got, got_kl = grad_and_kl(LAYOUTS[name], micro_batch_size=micro_batch_size)
        assert_same_gradient(got, want)
        assert got_kl == pytest.approx(kl, rel=1e-9)
    two_ranks = [[[0, 1, 2], [3]], [[4, 5], [6, 7]]]
    shares = [grad_and_kl(two_ranks, rank=r, world_size=2)[0] for r in (0, 1)]
    assert_same_gradient((shares[0] + shares[1]) / 2, want)


def test_splitting_the_batch_does_not_change_the_metrics(tiny_llama64, samples):
    """What a user compares across runs is independent of data.micro_batch_size too: mismatch_kl was measured on
    the first micro-batch alone, so its value changed with the split (and covered 1/8 of the batch at 8 rows)."""
    cfg = LossConfig(type="ppo_clip", clip_ratio_c=1.1, kl_tau=0.01)

    def metrics(layout, micro_batch_size):
        tiny_llama64.zero_grad(set_to_none=True)
        out = compute_gradients(tiny_llama64, make_batch(samples, LAYOUTS[layout]), loss_cfg=cfg,
                                ref_model=tiny_llama64, micro_batch_size=micro_batch_size)  # fmt: skip
        tiny_llama64.zero_grad(set_to_none=True)
        return out

    reference = metrics("1 micro-batch", 1)
    assert reference["mismatch_kl"] > 1e-3 and 0 < reference["clip_frac"] < 1
    for layout, micro_batch_size in (("4 micro-batches", 1), ("8 single-sample rows", 3)):
        got = metrics(layout, micro_batch_size)
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (layout, name)


def test_ratio_one_gives_the_reinforce_gradient_on_the_model(tiny_llama64):
    rng = np.random.default_rng(1)
    samples = random_samples(rng, LENGTHS)
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.0, rng=rng)  # identical weights on both sides
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])

    def reinforce(per_sample_weight) -> torch.Tensor:
        """∇ of −Σ_i w_i Σ_t A_i·m_t·lp_t, written out directly."""
        tiny_llama64.zero_grad(set_to_none=True)
        for mb in batch.for_rank(0):
            ids, pos = torch.from_numpy(mb.input_ids).long(), torch.from_numpy(mb.position_ids).long()
            lp, _ = packed_logprobs(tiny_llama64, ids, pos, mb.sample_lengths)
            weight = torch.repeat_interleave(
                torch.tensor([per_sample_weight(mb, k) for k in range(mb.num_samples)], dtype=torch.float64),
                torch.from_numpy(mb.sample_lengths).long(),
            )
            adv, mask = torch.from_numpy(mb.advantages).double(), torch.from_numpy(mb.loss_mask)
            (-(weight * adv * lp * mask).sum()).backward()
        return flat_grad(tiny_llama64).clone()

    def loss_tokens(mb, k):
        start = int(mb.sample_lengths[:k].sum())
        return int(mb.loss_mask[start : start + mb.sample_lengths[k]].sum())

    token_mean = reinforce(lambda mb, k: 1 / batch.num_loss_tokens)
    seq_mean = reinforce(lambda mb, k: 1 / (loss_tokens(mb, k) * batch.num_samples))
    cases = [(name, "token-mean", token_mean) for name in ("aipo", "ppo_clip", "gspo", "cispo", "masked_is")]
    cases += [(name, "seq-mean-token-mean", seq_mean) for name in ("gspo", "ppo_clip")]
    for name, aggregation, expected in cases:
        got = gradient(tiny_llama64, batch, LossConfig(type=name, aggregation=aggregation))
        assert_same_gradient(got, expected)


def test_step_metrics_match_hand_computed_values(tiny_llama64):
    rng = np.random.default_rng(2)
    samples = random_samples(rng, LENGTHS)
    # r = e^−1 ≈ 0.37 on every loss token: ppo_clip clips exactly the tokens of samples with A < 0.
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.0, rng=rng, offset=-1.0)
    batch = make_batch(samples, LAYOUTS["4 micro-batches"])
    cfg = OptimConfig(lr=1e-3, warmup_steps=2)
    optimizer = build_optimizer(tiny_llama64, cfg)
    scheduler = build_scheduler(optimizer, cfg, None)
    before = flat_grad_norm_reference(tiny_llama64, batch)
    metrics = train_step(
        tiny_llama64, optimizer, scheduler, batch, loss_cfg=LossConfig(type="ppo_clip"), max_grad_norm=1e9
    ).metrics

    loss_tokens = [int(np.count_nonzero(s["loss_mask"])) for s in samples]
    adv = [float(s["advantages"][0]) for s in samples]
    total = sum(loss_tokens)
    clipped = sum(n for n, a in zip(loss_tokens, adv, strict=True) if a < 0)
    r = math.exp(-1.0)
    # Unclipped tokens (A > 0) contribute −r·A, clipped ones (A < 0) −0.8·A.
    loss = sum(-(r if a > 0 else 0.8) * a * n for n, a in zip(loss_tokens, adv, strict=True)) / total
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["clip_frac"] == pytest.approx(clipped / total)
    assert metrics["mismatch_kl"] == pytest.approx(r - (-1.0) - 1.0, rel=1e-6)  # r − log r − 1
    assert metrics["num_loss_tokens"] == total and metrics["num_tokens"] == sum(LENGTHS)
    assert metrics["num_samples"] == 8
    assert 0 < metrics["entropy"] <= math.log(1024)
    assert metrics["grad_norm"] == pytest.approx(before, rel=1e-9)
    assert metrics["lr"] == pytest.approx(0.5e-3) and metrics["skipped"] == 0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the schedule advanced
    assert all(p.grad is None for p in tiny_llama64.parameters())


def test_dr_grpo_normalises_by_the_batch_generation_budget(tiny_llama64, samples):
    """seq-mean-token-sum-norm divides by loss.max_tokens, else the batch's budget, else the longest sample."""
    cfg = LossConfig(aggregation="seq-mean-token-sum-norm")
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    longest = max(int(np.count_nonzero(s["loss_mask"])) for s in samples)
    by_longest = compute_gradients(tiny_llama64, batch, loss_cfg=cfg)["loss"]
    batch.max_tokens = 64
    by_budget = compute_gradients(tiny_llama64, batch, loss_cfg=cfg)["loss"]
    assert by_budget == pytest.approx(by_longest * longest / 64, rel=1e-9)
    configured = compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig(aggregation=cfg.aggregation, max_tokens=32))
    assert configured["loss"] == pytest.approx(by_budget * 2, rel=1e-9)
    tiny_llama64.zero_grad(set_to_none=True)


def test_correction_metrics_are_means_over_loss_tokens(tiny_llama64):
    rng = np.random.default_rng(6)
    samples = random_samples(rng, LENGTHS)
    # q = e^0.5 ≈ 1.65 on every loss token: a 1.5 cap truncates every one of them
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.0, rng=rng, offset=0.5)
    batch = make_batch(samples, LAYOUTS["4 micro-batches"])
    metrics = compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig(is_correction="token_tis", is_cap=1.5))
    assert metrics["is_weight"] == pytest.approx(1.5, rel=1e-6)
    assert metrics["is_corrected_frac"] == 1.0 and metrics["invalid_logprob_frac"] == 0.0
    assert metrics["clip_frac"] == 0.0  # the objective sees on-policy data
    tiny_llama64.zero_grad(set_to_none=True)


def test_log_probs_are_computed_at_the_batch_temperature(tiny_llama64):
    rng = np.random.default_rng(5)
    samples = random_samples(rng, LENGTHS)
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.0, rng=rng, temperature=0.5)
    batch = make_batch(samples, LAYOUTS["1 micro-batch"])
    batch.temperature = 0.5
    assert compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig())["mismatch_kl"] < 1e-9
    batch.temperature = 1.0  # the trainer at another temperature than inference: a visible mismatch
    assert compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig())["mismatch_kl"] > 1e-3
    override = compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig(), temperature=0.5)
    assert override["mismatch_kl"] < 1e-9


def flat_grad_norm_reference(model, batch) -> float:
    norm = gradient(model, batch, LossConfig(type="ppo_clip")).norm().item()
    model.zero_grad(set_to_none=True)
    return norm


def test_gradients_are_clipped_to_max_grad_norm(tiny_llama64, samples):
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    optimizer = torch.optim.SGD(tiny_llama64.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    start = torch.cat([p.detach().flatten() for p in tiny_llama64.parameters()])
    compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig())
    metrics = optimizer_step(tiny_llama64, optimizer, scheduler, max_grad_norm=1e-3)
    moved = torch.cat([p.detach().flatten() for p in tiny_llama64.parameters()]) - start
    assert metrics["grad_norm"] > 1e-3
    assert moved.norm().item() == pytest.approx(1e-3, rel=1e-6)  # SGD at lr 1 moves by the clipped gradient


def test_a_non_finite_gradient_skips_the_update(tiny_llama64, samples):
    samples[3]["advantages"][:] = np.nan
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    optimizer = build_optimizer(tiny_llama64, OptimConfig(lr=1e-2))
    scheduler = build_scheduler(optimizer, OptimConfig(lr=1e-2), None)
    start = [p.detach().clone() for p in tiny_llama64.parameters()]
    metrics = train_step(tiny_llama64, optimizer, scheduler, batch, loss_cfg=LossConfig(), max_grad_norm=1.0).metrics
    assert metrics["skipped"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(start, tiny_llama64.parameters(), strict=True))
    assert optimizer.state == {} or all(not s for s in optimizer.state.values())


def test_global_normalisers_below_the_local_counts_are_rejected(tiny_llama64, samples):
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    batch.num_loss_tokens = 3
    with pytest.raises(ValueError, match="global normalisers"):
        compute_gradients(tiny_llama64, batch, loss_cfg=LossConfig())


def test_a_user_objective_trains_through_train_step(tiny_llama64, samples, tmp_path, monkeypatch):
    (tmp_path / "user_reinforce.py").write_text(
        "import torch\nfrom gyre_trainer.loss import LossOutput\n\n"
        "def loss(lp, behaviour, adv, mask, lengths, cfg):\n"
        "    return LossOutput(torch.where(mask, -adv * lp, 0.0), {'user_frac': mask.double()})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    optimizer = build_optimizer(tiny_llama64, OptimConfig())
    scheduler = build_scheduler(optimizer, OptimConfig(), None)
    metrics = train_step(
        tiny_llama64, optimizer, scheduler, batch, loss_cfg=LossConfig(type="user_reinforce:loss"), max_grad_norm=1.0
    ).metrics
    assert metrics["user_frac"] == pytest.approx(1.0) and metrics["grad_norm"] > 0


def sft_rows(rng, lengths_per_row):
    batches = [make_batch(random_samples(rng, lengths), [[list(range(len(lengths)))]]) for lengths in lengths_per_row]
    return [b.for_rank(0)[0] for b in batches]


def test_sft_loss_is_the_token_mean_cross_entropy_and_split_invariant(tiny_llama64):
    rows = sft_rows(np.random.default_rng(3), [[12, 7], [9], [15, 4, 6]])
    global_tokens = sum(int(r.loss_mask.sum()) for r in rows)
    grads = []
    for micro_batch_size, parts in ((3, [rows]), (1, [rows]), (2, [rows[:1], rows[1:]])):
        tiny_llama64.zero_grad(set_to_none=True)
        for part in parts:  # parts play data-parallel ranks: each normalises by the global count
            compute_sft_gradients(
                tiny_llama64, part, micro_batch_size=micro_batch_size, global_loss_tokens=global_tokens
            )
        grads.append(flat_grad(tiny_llama64).clone())
    for g in grads[1:]:
        assert_same_gradient(g, grads[0])
    # Reference: transformers' own next-token loss, sample by sample, prompt tokens ignored.
    total, count = 0.0, 0
    for row in rows:
        start = 0
        for n in row.sample_lengths:
            ids = torch.from_numpy(row.input_ids[start : start + n]).long().unsqueeze(0)
            labels = torch.where(torch.from_numpy(row.loss_mask[start : start + n]), ids, -100)
            with torch.no_grad():
                out = tiny_llama64(input_ids=ids, labels=labels)
            k = int((labels[0, 1:] != -100).sum())
            total, count = total + out.loss.item() * k, count + k
            start += n
    cfg = OptimConfig(lr=1e-3)
    optimizer = build_optimizer(tiny_llama64, cfg)
    scheduler = build_scheduler(optimizer, cfg, None)
    metrics = sft_step(tiny_llama64, optimizer, scheduler, rows, max_grad_norm=1.0, micro_batch_size=2).metrics
    assert count == global_tokens  # every loss token has a predecessor: prompts are never empty
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-7)  # transformers' loss runs in float32
    assert metrics["num_loss_tokens"] == count and metrics["grad_norm"] > 0


def test_sft_reduces_the_loss(tiny_llama):
    rows = sft_rows(np.random.default_rng(4), [[20, 12], [16, 16]])
    cfg = OptimConfig(lr=1e-2)
    optimizer = build_optimizer(tiny_llama, cfg)
    scheduler = build_scheduler(optimizer, cfg, None)
    losses = [sft_step(tiny_llama, optimizer, scheduler, rows, max_grad_norm=1.0).metrics["loss"] for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tiny_model, tiny_llama64, samples, tmp_path):
    """Real torch.distributed: the ranks' averaged gradient and the all-reduced metrics equal one process's."""
    loss_cfg = LossConfig(type="ppo_clip", aggregation="seq-mean-token-mean")
    layout = [[[0, 1, 2], [3]], [[4, 5], [6, 7]]]
    out = tmp_path / "rank0.pt"
    mp.spawn(
        dp_worker,
        args=(2, str(tmp_path / "init"), str(tiny_model), samples, layout, loss_cfg, str(out)),
        nprocs=2,
        join=True,
    )
    got = torch.load(out)
    tiny_llama64.zero_grad(set_to_none=True)
    single = compute_gradients(tiny_llama64, make_batch(samples, [[[0, 1, 2], [3], [4, 5], [6, 7]]]), loss_cfg=loss_cfg)
    assert_same_gradient(got["grad"], flat_grad(tiny_llama64))
    for key in ("loss", "entropy", "clip_frac", "num_tokens", "num_loss_tokens", "ratio_mean", "ratio_min",
                "ratio_max"):  # fmt: skip
        assert got["metrics"][key] == pytest.approx(single[key], rel=1e-9), key


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.05])
def test_a_rank_holding_only_padding_rows_runs_its_backward_with_a_zero_gradient(tiny_llama64, entropy_coeff):
    """Fewer samples than ranks: the packer gives the empty rank a one-token padding row. Its forward has no token
    to predict, and the chunked log-prob kernel crashed on it (the step died on that rank, and FSDP2's others
    waited for it); it must run its backward (FSDP2's gradient reduction needs every rank) with a gradient of 0,
    so the ranks' average is the one-process gradient."""
    samples = [TrainSample(np.arange(3, 13), np.arange(10) >= 4, np.full(10, -1.5, np.float32), 0.7)]
    cfg = LossConfig(entropy_coeff=entropy_coeff)
    batch = pack_batch(1, samples, seq_len=64, world_size=2).batch
    assert [[len(row.input_ids) for row in rank] for rank in batch.micro_batches] == [[10], [1]]
    shares = []
    for rank in (0, 1):
        tiny_llama64.zero_grad(set_to_none=True)
        metrics = compute_gradients(tiny_llama64, batch, loss_cfg=cfg, rank=rank, world_size=2)
        assert all(p.grad is not None for p in tiny_llama64.parameters()), rank  # the backward ran
        shares.append((flat_grad(tiny_llama64).clone(), metrics["loss"]))
    assert shares[1][0].abs().max() == 0 and shares[1][1] == 0
    single = gradient(tiny_llama64, pack_batch(1, samples, seq_len=64).batch, cfg)
    assert_same_gradient((shares[0][0] + shares[1][0]) / 2, single)


@pytest.mark.parametrize(
    "loss_cfg",
    [
        LossConfig(type="ppo_clip", clip_ratio_c=1.2, kl_tau=0.05),
        LossConfig(type="gspo", eps_low=0.02, eps_high=0.03, is_correction="token_mask", is_cap=1.4, is_cap_low=0.7),
        LossConfig(type="cispo", aggregation="seq-mean-token-sum-norm", is_correction="seq_tis", is_cap=1.5),
        LossConfig(type="aipo", delta=1.3, aggregation="seq-mean-token-sum"),
        LossConfig(type="masked_is", mask_low=0.9, mask_high=1.1, sequence_mask=True, aggregation="token-sum"),
    ],
    ids=lambda c: f"{c.type}-{c.aggregation}-{c.is_correction}",
)
def test_the_packers_batches_train_the_documented_per_sample_gradient(tiny_llama64, loss_cfg):
    """End to end from the orchestrator's packer: whatever `seq_len` (samples per row), data-parallel ranks (padding
    rows where samples are fewer than rank slots) and micro-batch size, the ranks' averaged gradient is that of the
    docs' batch loss written sample by sample (`test_trainer_loss_reference`), each sample run through the model
    alone: every token's gradient weight is independent of how it was packed."""
    from test_trainer_loss_reference import reference_batch_loss

    rng, temperature = np.random.default_rng(1), 0.7
    samples, reference = [], []
    for _ in range(9):
        length = int(rng.integers(3, 20))
        ids = rng.integers(3, 1000, length)
        mask = (np.arange(length) >= rng.integers(1, length)) & (rng.random(length) > 0.15)
        with torch.no_grad():
            lp = packed_logprobs(tiny_llama64, torch.as_tensor(ids), torch.arange(length), [length], temperature)[0]
        mu = np.where(mask, lp.numpy() + rng.normal(0, 0.3, length), 0.0).astype(np.float32)
        samples.append(TrainSample(ids, mask, mu, float(np.float32(rng.normal()))))  # the batch's float32 value
        reference.append({"mu": torch.as_tensor(mu, dtype=torch.float64), "mask": mask.tolist(),
                          "adv": samples[-1].advantage})  # fmt: skip
    tiny_llama64.zero_grad(set_to_none=True)
    for s, r in zip(samples, reference, strict=True):
        r["lp"] = packed_logprobs(tiny_llama64, torch.as_tensor(s.input_ids), torch.arange(s.length), [s.length],
                                  temperature)[0]  # fmt: skip
    norms = {"global_tokens": sum(s.num_loss_tokens for s in samples), "global_samples": len(samples), "max_tokens": 32}
    want = reference_batch_loss(loss_cfg.model_copy(update={"max_tokens": 32}), reference, norms)
    want.backward()
    want_grad = flat_grad(tiny_llama64).clone()
    cfg = loss_cfg.model_copy(update={"max_tokens": 32})
    for seq_len, world_size, micro_batch_size in ((200, 1, 1), (40, 1, 2), (20, 2, 1), (25, 3, 2), (19, 12, 1)):
        batch = pack_batch(1, samples, seq_len=seq_len, world_size=world_size, temperature=temperature).batch
        shares, loss = [], 0.0
        for rank in range(world_size):
            tiny_llama64.zero_grad(set_to_none=True)
            loss += compute_gradients(tiny_llama64, batch, loss_cfg=cfg, rank=rank, world_size=world_size,
                                      micro_batch_size=micro_batch_size)["loss"]  # fmt: skip
            shares.append(flat_grad(tiny_llama64).clone())
        assert_same_gradient(sum(shares) / world_size, want_grad)
        assert loss == pytest.approx(want.item(), rel=1e-7), (seq_len, world_size)  # float32 advantages in the batch


def test_a_lora_models_reference_is_its_base_with_the_adapters_off(tiny_model, samples):
    """`lora.AdaptersOff(model)` as the KL reference gives the gradient a separate frozen copy of the base
    gives (no second copy of the weights), and leaves the adapters on and trainable afterwards."""
    from gyre.config.trainer import LoraConfig, ModelConfig
    from gyre_trainer.lora import AdaptersOff, apply_lora
    from gyre_trainer.model import load_model

    def fp64():
        return load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64)

    base = fp64().requires_grad_(False)
    model = apply_lora(fp64(), LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():  # a trained adapter: B != 0 moves the policy away from the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    cfg = LossConfig(type="aipo", ref_kl_coef=0.5)

    def grad_and_kl(ref):
        model.zero_grad(set_to_none=True)
        metrics = compute_gradients(model, batch, loss_cfg=cfg, micro_batch_size=4, ref_model=ref)
        return torch.cat([p.grad.flatten() for p in trainable]).clone(), metrics["ref_kl"]

    with_copy, kl_copy = grad_and_kl(base)
    adapters_off, kl_off = grad_and_kl(AdaptersOff(model))
    assert kl_copy > 1e-4 and kl_off == pytest.approx(kl_copy, rel=1e-9)
    assert_same_gradient(adapters_off, with_copy)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".lora_" in n
    ]


def test_kl_and_weight_means_leave_out_tokens_with_an_impossible_inference_logprob(tiny_llama64):
    """mismatch_kl, is_weight and ref_kl are 0 on a token whose inference log-prob is impossible (it is out of every
    term): they are means over the valid loss tokens, not diluted by the invalid ones."""
    rng = np.random.default_rng(6)
    samples = random_samples(rng, LENGTHS)
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.0, rng=rng, offset=0.5)  # log q = 0.5 on every token
    for s in samples[:3]:
        s["inference_logprobs"][s["loss_mask"]] = -1e4
    batch = make_batch(samples, LAYOUTS["1 micro-batch"])
    cfg = LossConfig(is_correction="token_tis", is_cap=1.5)
    metrics = compute_gradients(tiny_llama64, batch, loss_cfg=cfg, ref_model=tiny_llama64)
    tiny_llama64.zero_grad(set_to_none=True)
    invalid = sum(int(np.count_nonzero(s["loss_mask"])) for s in samples[:3])
    assert metrics["invalid_logprob_frac"] == pytest.approx(invalid / metrics["num_loss_tokens"])
    assert metrics["is_weight"] == pytest.approx(1.5, rel=1e-6)
    assert metrics["mismatch_kl"] == pytest.approx(math.exp(0.5) - 0.5 - 1.0, rel=1e-6)
    assert metrics["ref_kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["num_valid_tokens"] == metrics["num_loss_tokens"] - invalid


def _trained_once(model, samples, cfg: OptimConfig):
    """An AdamW with moments and a step count: one real step on `samples`."""
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, None)
    train_step(model, optimizer, scheduler, make_batch(samples, LAYOUTS["2 micro-batches"]), loss_cfg=LossConfig(),
               max_grad_norm=1.0)  # fmt: skip
    return optimizer, scheduler


@pytest.mark.parametrize("empty", ["no loss token", "impossible inference log-probs", "every advantage 0"])
def test_a_batch_without_signal_skips_the_update_but_counts_as_a_step(tiny_llama64, samples, empty, caplog):
    """A batch with nothing to learn from (every token masked, every inference log-prob impossible, a zero-signal
    batch the orchestrator closes when its budget runs out) has a zero gradient. AdamW's step on it is not a no-op:
    it replays the decayed momentum and applies weight decay. The update is skipped, the schedule advances."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    optimizer, scheduler = _trained_once(tiny_llama64, samples, cfg)
    for s in samples:
        if empty == "no loss token":
            s["loss_mask"][:] = False
        elif empty == "impossible inference log-probs":
            s["inference_logprobs"][:] = -1e4
        else:
            s["advantages"][:] = 0.0
    before = [p.detach().clone() for p in tiny_llama64.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    with caplog.at_level("WARNING", logger="gyre_trainer.step"):
        batch = make_batch(samples, LAYOUTS["2 micro-batches"], step=2)
        result = train_step(tiny_llama64, optimizer, scheduler, batch, loss_cfg=LossConfig(), max_grad_norm=1.0)
    metrics = result.metrics
    assert metrics["skipped"] == 1 and metrics["grad_norm"] == 0.0
    reason = "zero gradient" if empty == "every advantage 0" else "no valid loss token"
    assert reason in metrics["skip_reason"] and f"batch 2: optimizer update skipped: {reason}" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_llama64.parameters(), strict=True))
    after = list(optimizer.state.values())
    assert all(torch.equal(s[k], a[k]) for s, a in zip(state, after, strict=True) for k in s)  # moments, step count
    assert scheduler.last_epoch == 2  # the schedule counts the step
    assert all(p.grad is None for p in tiny_llama64.parameters())


def test_entropy_bonus_adds_minus_coeff_times_the_gradient_of_the_mean_entropy(tiny_llama64, samples):
    """loss.entropy_coeff = c adds −c·∇(Σ_t m_t·H_t / N) to the objective's gradient (token-mean: N the batch's loss
    tokens), H_t the policy's entropy at the token, differentiated through the model."""
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    tiny_llama64.zero_grad(set_to_none=True)
    for mb in batch.for_rank(0):
        ids, pos = torch.from_numpy(mb.input_ids).long(), torch.from_numpy(mb.position_ids).long()
        _, entropy = packed_logprobs(tiny_llama64, ids, pos, mb.sample_lengths, entropy_grad=True)
        mask = torch.from_numpy(mb.loss_mask)
        # c inside the loss, as the trainer has it: the model's RMSNorm computes in float32 even for a float64
        # model, so c·∇f and ∇(c·f) differ by float32 rounding
        (-0.3 * torch.where(mask, entropy, 0.0).sum() / batch.num_loss_tokens).backward()
    bonus = flat_grad(tiny_llama64).clone()
    plain = gradient(tiny_llama64, batch, LossConfig(type="ppo_clip"))
    assert_same_gradient(gradient(tiny_llama64, batch, LossConfig(type="ppo_clip", entropy_coeff=0.3)), plain + bonus)
    for sample in samples:  # no advantage: the bonus is the whole gradient
        sample["advantages"][:] = 0.0
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    assert_same_gradient(gradient(tiny_llama64, batch, LossConfig(type="ppo_clip", entropy_coeff=0.3)), bonus)
    tiny_llama64.zero_grad(set_to_none=True)


def test_importance_ratio_metrics_are_over_the_valid_loss_tokens(tiny_llama64):
    """ratio_mean, ratio_min, ratio_max of r = π_θ/μ: what PRIME-RL and verl users read next to mismatch_kl to see
    whether trainer and inference disagree on a few tokens (a large max) or on all (the mean)."""
    rng = np.random.default_rng(7)
    samples = random_samples(rng, LENGTHS)
    set_behaviour_logprobs(tiny_llama64, samples, noise=0.4, rng=rng)
    samples[2]["inference_logprobs"][samples[2]["loss_mask"]] = -1e4  # impossible: not a ratio of e^(lp + 1e4)
    ratios = []
    with torch.no_grad():
        for s in samples[:2] + samples[3:]:
            ids = torch.as_tensor(s["input_ids"], dtype=torch.long)
            lp, _ = packed_logprobs(tiny_llama64, ids, torch.arange(len(ids)), [len(ids)])
            behaviour = torch.from_numpy(s["inference_logprobs"]).double()  # float32 as the batch carries it
            ratios += (lp - behaviour).exp()[torch.from_numpy(s["loss_mask"])].tolist()
    for layout in ("1 micro-batch", "4 micro-batches"):
        metrics = compute_gradients(tiny_llama64, make_batch(samples, LAYOUTS[layout]), loss_cfg=LossConfig())
        tiny_llama64.zero_grad(set_to_none=True)
        assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-9), layout
        assert metrics["ratio_min"] == pytest.approx(min(ratios), rel=1e-9), layout
        assert metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-9), layout
        assert metrics["ratio_max"] > 1.5 and metrics["ratio_min"] < 0.7  # noise 0.4 spreads them
    for s in samples:  # no valid loss token at all: no ratio to report
        s["inference_logprobs"][s["loss_mask"]] = -1e4
    metrics = compute_gradients(tiny_llama64, make_batch(samples, LAYOUTS["1 micro-batch"]), loss_cfg=LossConfig())
    assert not {"ratio_mean", "ratio_min", "ratio_max"} & metrics.keys()


def test_the_entropy_bonus_raises_the_policys_entropy_step_after_step(tiny_llama, samples):
    """Behaviour, not only the formula: with no advantage at all, updates on the entropy bonus alone make the policy's
    entropy on the batch's tokens go up every step (and without the bonus there is no update: a zero gradient)."""
    for sample in samples:
        sample["advantages"][:] = 0.0
    batch = make_batch(samples, LAYOUTS["2 micro-batches"])
    cfg = OptimConfig(lr=1e-3)
    optimizer = build_optimizer(tiny_llama, cfg)
    scheduler = build_scheduler(optimizer, cfg, None)

    def step(entropy_coeff: float) -> dict:
        loss_cfg = LossConfig(type="ppo_clip", entropy_coeff=entropy_coeff)
        return train_step(tiny_llama, optimizer, scheduler, batch, loss_cfg=loss_cfg, max_grad_norm=1.0).metrics

    assert step(0.0)["skipped"] == 1  # no signal without the bonus
    entropies = [step(0.5)["entropy"] for _ in range(4)]
    assert all(b > a for a, b in zip(entropies, entropies[1:], strict=False)), entropies
