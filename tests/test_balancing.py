"""Quantile Balancing (exact update, its fixed point, histogram, block statistics, the drift correction,
distributed/micro-batch equivalence), the loss-free baseline, and the training hooks."""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import TrainerControl, TrainerState, TrainingArguments

from kdamoe import balancing
from kdamoe.balancing import LoadBalancingCallback, register_load_balancing_hook
from kdamoe.model.configuration_kdamoe import KDAMoEConfig
from kdamoe.model.moe import (
    KDAMoESparseMoeBlock,
    QuantileHistogram,
    balanced_bias,
    loss_free_balance,
    max_violation,
    quantile_balance,
    quantile_fixed_point,
    selection_thresholds,
    smoothed_bias,
)

E, K, N = 16, 2, 2048
MU = torch.linspace(-2.0, 1.0, E, dtype=torch.float64)  # skewed experts: the last ones win most tokens


def skewed_scores(gen, n=N):
    return torch.sigmoid(MU + 0.7 * torch.randn(n, E, generator=gen, dtype=torch.float64))


def loads_of(scores, bias, k=K):
    index = torch.topk(scores + bias, k, dim=1).indices
    return torch.bincount(index.reshape(-1), minlength=scores.shape[1])


def make_config(**kw):
    base = dict(num_hidden_layers=1, mlp_layer_types=["dense"], hidden_size=32, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=8, num_shared_experts=0, quantile_num_bins=1000)
    base.update(kw)
    return KDAMoEConfig(**base)


def dyadic_block(config, seed=0):
    """Block whose router matmul is exact in fp32 (dyadic weights), so any batching gives bit-identical scores."""
    gen = torch.Generator().manual_seed(seed)
    block = KDAMoESparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=gen) / 64.0)
        skew = torch.linspace(-1.0, 1.0, config.num_experts) / 2.0  # experts prefer different inputs unequally
        block.router.weight[:, 0] = skew
    return block.train()


def dyadic_inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, shape, generator=gen) / 8.0
    x[..., 0] = 1.0  # a constant feature that carries the expert skew
    return x


# ----------------------------------------------------------------------------------------------- exact update


def test_quantile_balance_matches_independent_float64():
    gen = torch.Generator().manual_seed(0)
    scores = skewed_scores(gen, 300)
    bias = torch.randn(E, generator=gen, dtype=torch.float64) * 0.1
    got = quantile_balance(scores, bias, K).numpy()
    s, b = scores.numpy(), bias.numpy()
    cutoff = -np.sort(-(s + b), axis=1)[:, K]  # (k+1)-th largest biased score
    want = np.array([np.quantile(cutoff - s[:, j], K / E) for j in range(E)])
    np.testing.assert_allclose(got, want - want.mean(), rtol=0, atol=1e-12)
    assert abs(got.mean()) < 1e-12


def test_quantile_balance_rejects_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        quantile_balance(torch.rand(5, 4), torch.zeros(4), 4)
    with pytest.raises(ValueError, match="bias"):
        quantile_balance(torch.rand(5, 4), torch.zeros(3), 1)


def test_repeated_update_on_one_batch_converges():
    scores = skewed_scores(torch.Generator().manual_seed(1))
    bias = torch.zeros(E, dtype=torch.float64)
    assert max_violation(loads_of(scores, bias)) > 3.0
    vio = []
    for _ in range(6):
        bias = quantile_balance(scores, bias, K)
        vio.append(max_violation(loads_of(scores, bias)))
    assert 0.3 < vio[0] < 0.8  # one update leaves about 0.5: the cutoffs move with the bias
    assert min(vio) < 0.05


def test_stream_of_fresh_batches_stays_balanced_and_beats_loss_free():
    gen = torch.Generator().manual_seed(2)
    bias_qb = torch.zeros(E, dtype=torch.float64)
    bias_lf = torch.zeros(E, dtype=torch.float64)
    vio_qb, vio_lf = [], []
    for _ in range(10):
        scores = skewed_scores(gen)
        loads_qb, loads_lf = loads_of(scores, bias_qb), loads_of(scores, bias_lf)
        vio_qb.append(max_violation(loads_qb))
        vio_lf.append(max_violation(loads_lf))
        bias_qb = quantile_balance(scores, bias_qb, K)
        bias_lf = loss_free_balance(loads_lf, bias_lf, 1e-3)
    assert vio_qb[0] > 3.0
    assert max(vio_qb[4:]) < 0.3
    # a single QB update already beats 10 loss-free steps on the same stream
    assert vio_qb[1] < vio_lf[-1]
    assert vio_qb[1] < min(vio_lf)


def test_loss_free_and_max_violation_formulas():
    loads = torch.tensor([10, 30, 15, 5])  # mean 15
    torch.testing.assert_close(loss_free_balance(loads, torch.zeros(4), 0.5), torch.tensor([0.5, -0.5, 0.0, 0.5]))
    assert max_violation(loads) == pytest.approx((30 - 15) / 15)
    with pytest.raises(ValueError):
        max_violation(torch.zeros(4))


# ----------------------------------------------------------------------------------------------- histogram


def test_histogram_quantile_within_one_bin_of_exact():
    gen = torch.Generator().manual_seed(3)
    r = torch.cat([torch.randn(20000, 5, generator=gen, dtype=torch.float64) * 0.2,
                   torch.rand(20000, 3, generator=gen, dtype=torch.float64) * 1.5 - 1.0], 1)
    hist = QuantileHistogram(8, 1000, -2.0, 2.0)
    for chunk in r.split(7000):
        hist.add(chunk)
    assert hist.counts.sum(1).eq(20000).all()
    width = 4.0 / 1000
    for q in (0.01, 0.125, 0.5, 0.9):
        exact = torch.quantile(r, q, dim=0)
        assert (hist.quantile(q) - exact).abs().max() < width
    # coarse bins: the error bound scales with the bin width
    coarse = QuantileHistogram(8, 20, -2.0, 2.0)
    coarse.add(r)
    assert (coarse.quantile(0.125) - torch.quantile(r, 0.125, dim=0)).abs().max() < 4.0 / 20


def test_refined_histogram_reads_a_narrow_quantile():
    """A router whose scores barely differ between tokens: the coarse read is off by a good part of their spread,
    the second pass inside the bin found is within range / bins^2 (plus the gap between neighbouring values)."""
    gen = torch.Generator().manual_seed(5)
    r = 0.3 + 0.002 * torch.randn(20000, 4, generator=gen, dtype=torch.float64)
    coarse = QuantileHistogram(4, 1000, -2.0, 2.0)
    coarse.add(r)
    fine = coarse.refine(0.125)
    fine.add(r)
    exact = torch.quantile(r, 0.125, dim=0)
    assert (fine.quantile(0.125) - exact).abs().max() < 4.0 / 1000**2 + 1e-5
    assert (coarse.quantile(0.125) - exact).abs().max() > 1e-4
    assert torch.equal(fine.counts.sum(1), coarse.counts.sum(1))
    with pytest.raises(ValueError, match="scalars or"):
        QuantileHistogram(4, 10, torch.zeros(3), torch.ones(3))


# ----------------------------------------------------------------------------------------------- block statistics


def test_block_update_matches_the_exact_fixed_point():
    config = make_config()
    block = dyadic_block(config)
    x = dyadic_inputs((4, 64, 32), seed=1)
    bias0 = torch.linspace(-0.05, 0.05, 8)
    block.router.bias.copy_(bias0)
    _, logits, _ = block(x)
    stats = block.apply_balancing()
    scores = torch.sigmoid(logits.double())
    new = block.router.bias.double()
    # no optimizer step: nothing drifted, so the update is the histogram read-out of the exact fixed point (on the
    # block's fp32 scores)
    torch.testing.assert_close(new, balanced_bias(torch.sigmoid(logits), bias0, 2, config.quantile_iterations, 1000),
                               rtol=0, atol=1e-7)
    exact = quantile_fixed_point(scores, bias0.double(), 2, config.quantile_iterations)
    assert (new - exact).abs().max() < 3e-3  # the two quantile definitions differ by a gap between thresholds
    assert (loads_of(scores, new) - loads_of(scores, exact)).abs().max() <= 3
    assert max_violation(loads_of(scores, new)) < 0.1 < max_violation(loads_of(scores, bias0.double()))
    assert abs(new.mean().item()) < 1e-6
    want_loads = loads_of(scores, bias0.double(), 2)  # the statistics report the routing with the old bias
    assert torch.equal(stats["loads"], want_loads)
    assert stats["max_vio"] == pytest.approx(max_violation(want_loads))
    assert stats["dead_experts"] == int((want_loads == 0).sum())
    assert stats["bias_norm"] == pytest.approx(new.norm().item())
    updated = block.router.bias.clone()
    assert block.apply_balancing() == {}  # statistics were reset: nothing pending, no change
    assert torch.equal(block.router.bias, updated)


def _filter_stream(walk, noise, window=16, steps=300, seed=0):
    """`smoothed_bias` on fixed points = a random walk (step std `walk`) + independent noise (std `noise`), 64
    experts: (late gain, late squared error of the bias routed with against the centred truth, of replacing)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda: torch.randn(1, 64, generator=gen, dtype=torch.float64)
    truth, bias, state = torch.zeros(1, 64, dtype=torch.float64), None, torch.zeros(1, 131)
    gains, errs, first = [], [], []
    for t in range(steps):
        truth = truth + walk * randn()
        y = truth + noise * randn()
        y = y - y.mean(-1, keepdim=True)
        if bias is not None:
            errs.append(((bias - (truth - truth.mean())) ** 2).mean().item())
        new, state, gain = smoothed_bias(y, y if bias is None else bias, state, window)
        if t < 5:
            first.append(torch.equal(new, y))
        bias = new
        gains.append(gain.item())
    return np.mean(gains[-100:]), np.mean(errs[-100:]), noise**2 + walk**2, all(first)


def test_smoothed_bias_takes_the_kalman_gain_of_its_fixed_points():
    """The filter's gain against the steady-state gain of the local-level Kalman filter, `(-q + sqrt(q² + 4q)) / 2`
    with q = drift / noise variance: 1 when the fixed points only drift (the bias is the newest fixed point), the
    Kalman gain in between, `1 / window` when they are only noise; its bias errs less than the newest fixed point
    would. The first steps (fewer than 4 difference pairs) take the fixed point as it is."""
    kalman = lambda q: (-q + np.sqrt(q * q + 4 * q)) / 2
    gain, err, replace, first = _filter_stream(walk=0.1, noise=0.0)
    assert first and gain > 0.98 and err == pytest.approx(replace, rel=0.3)
    for walk in (0.02, 0.05, 0.1):
        gain, err, replace, first = _filter_stream(walk=walk, noise=0.1)
        assert first and abs(gain - kalman(walk**2 / 0.01)) < 0.08, walk
        assert err < 0.85 * replace, walk
    gain, err, replace, _ = _filter_stream(walk=0.0, noise=0.1, window=16)
    assert gain < 0.15 and err < 0.1 * replace


def test_block_with_a_window_averages_the_noise_of_fresh_batches():
    """`quantile_window` on a block routing fresh batches from one distribution (no optimizer step: no drift): the
    first steps set the same biases as `quantile_window=1` (gain 1), later the filter averages batches, so the batch
    each bias routes is better balanced than with the newest fixed point alone."""
    vios, biases = {}, {}
    for window in (1, 8):
        block = dyadic_block(make_config(quantile_window=window))
        vios[window], biases[window] = [], []
        for step in range(60):
            block(dyadic_inputs((2, 32, 32), seed=100 + step))
            vios[window].append(block.apply_balancing()["max_vio"])
            biases[window].append(block.router.bias.clone())
    for step in range(4):
        torch.testing.assert_close(biases[8][step], biases[1][step], rtol=0, atol=1e-6)
    assert not torch.allclose(biases[8][-1], biases[1][-1])
    assert np.mean(vios[8][20:]) < 0.8 * np.mean(vios[1][20:])


@pytest.mark.parametrize("group_elements", [1 << 26, 1])
def test_blocks_updated_together_equal_each_updated_alone(monkeypatch, group_elements):
    """`apply_balancing(blocks)` batches the layers' updates (split into groups when they would not fit): the same
    biases and statistics as one block at a time, for quantile and loss_free blocks in one call."""
    import copy

    from kdamoe.model import moe

    monkeypatch.setattr(moe, "BALANCE_GROUP_ELEMENTS", group_elements)
    blocks = [dyadic_block(make_config(), seed=i) for i in range(3)]
    blocks.append(dyadic_block(make_config(router_balancing="loss_free", loss_free_update_rate=0.01), seed=3))
    x = dyadic_inputs((4, 32, 32), seed=5)
    for block in blocks:
        block(x)
    alone = [copy.deepcopy(block) for block in blocks]
    together = moe.summary_to_host(moe.apply_balancing(blocks))
    for block, single, stats in zip(blocks, alone, together):
        want = single.apply_balancing()
        torch.testing.assert_close(block.router.bias, single.router.bias, rtol=0, atol=1e-12)
        assert torch.equal(stats["loads"], want["loads"]) and stats["dead_experts"] == want["dead_experts"]
        assert stats["max_vio"] == pytest.approx(want["max_vio"]) and stats["bias_norm"] == pytest.approx(
            want["bias_norm"])
    assert not torch.equal(blocks[0].router.bias, blocks[1].router.bias)
    assert moe.apply_balancing(blocks) == [{}] * 4


def skewed_block(seed=0, experts=E):
    """A block with continuous weights whose router prefers some experts for every token (a shared input feature,
    as early in training), so that its first batch routes onto a few experts."""
    config = make_config(num_experts=experts, hidden_size=64)
    block = KDAMoESparseMoeBlock(config).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        block.router.weight[:, 0] = torch.linspace(-2.0, 1.0, experts)
    x = torch.randn(2, N // 2, 64, generator=gen)
    x[..., 0] = 1.0
    return block, x


def routed_max_vio(block, x) -> float:
    with torch.no_grad():
        _, logits, _ = block(x)
    return max_violation(loads_of(torch.sigmoid(logits.double()), block.router.bias.double()))


def test_one_optimizer_step_balances_a_fixed_batch():
    """Where the single quantile update needs about six alternations on a fixed batch, the block's update (the fixed
    point, iterated on the step's own histograms) balances it in one optimizer step."""
    block, x = skewed_block()
    _, logits, _ = block(x)
    scores = torch.sigmoid(logits.double())
    assert max_violation(loads_of(scores, torch.zeros(E, dtype=torch.float64))) > 3.0
    single = quantile_balance(scores, torch.zeros(E, dtype=torch.float64), K)
    assert max_violation(loads_of(scores, single)) > 0.3
    block.apply_balancing()
    assert routed_max_vio(block, x) < 0.05


def test_fixed_point_matches_independent_float64_reference():
    """The textbook single update (numpy, float64) alternated to convergence and `quantile_fixed_point`'s four steps
    reach the same balanced bias; so does the histogram read-out."""
    scores = skewed_scores(torch.Generator().manual_seed(1))
    s, b = scores.numpy(), np.zeros(E)
    for _ in range(300):
        cutoff = -np.sort(-(s + b), axis=1)[:, K]
        b = np.array([np.quantile(cutoff - s[:, j], K / E) for j in range(E)])
        b -= b.mean()
    reference = torch.from_numpy(b)
    assert torch.equal(loads_of(scores, reference), torch.full((E,), N * K // E))
    zero = torch.zeros(E, dtype=torch.float64)
    for new in (quantile_fixed_point(scores, zero, K, 4), balanced_bias(scores, zero, K, 4, 1000)):
        assert (new - reference).abs().max() < 2e-3
        assert max_violation(loads_of(scores, new)) < 0.03
    assert max_violation(loads_of(scores, quantile_fixed_point(scores, zero, K, 1))) > 0.1  # one step is not enough


def test_selection_thresholds_decide_the_selection():
    gen = torch.Generator().manual_seed(4)
    scores = skewed_scores(gen, 500)
    bias = torch.randn(E, generator=gen, dtype=torch.float64) * 0.2
    r = selection_thresholds(scores, bias, K)
    picked = torch.zeros(500, E, dtype=torch.bool).scatter_(1, torch.topk(scores + bias, K, dim=1).indices, True)
    assert torch.equal(bias > r, picked)
    cutoff = torch.topk(scores + bias, K + 1, dim=1).values[:, K:]
    torch.testing.assert_close(r[picked], (cutoff - scores)[picked])  # quantile_balance's r where j is picked
    assert (r[~picked] >= (cutoff - scores)[~picked]).all()  # and never below it elsewhere


def test_update_is_set_for_the_router_after_the_optimizer_step():
    """An optimizer step that moves each expert's logit by more than its spread across tokens: the bias fitted to the
    logits as they were routes the next forward onto a few experts; the block's update (the window's logits moved
    by the step's change at the mean router input) balances it."""
    block, x = skewed_block(seed=1)
    _, logits, _ = block(x)
    stale = balanced_bias(torch.sigmoid(logits.double()), block.router.bias, K, 4, 1000)
    with torch.no_grad():  # the step: a token-independent change of every expert's logit
        block.router.weight[:, 0] += torch.linspace(1.0, -1.0, E)
    block.apply_balancing()
    assert routed_max_vio(block, x) < 0.05
    block.router.bias.copy_(stale)
    assert routed_max_vio(block, x) > 1.0


def test_micro_batches_equal_one_big_batch():
    config = make_config()
    x = dyadic_inputs((8, 32, 32), seed=2)
    big, micro = dyadic_block(config), dyadic_block(config)
    big(x)
    for part in x.split(2):
        micro(part)
    s_big, s_micro = big.apply_balancing(), micro.apply_balancing()
    assert torch.equal(s_big["loads"], s_micro["loads"])
    assert torch.equal(big.router.bias, micro.router.bias)
    assert not torch.equal(big.router.bias, torch.zeros(8))


def test_token_mask_excludes_padding():
    config = make_config()
    x = dyadic_inputs((2, 40, 32), seed=3)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 25:] = False
    masked, real = dyadic_block(config), dyadic_block(config)
    masked(x, mask)
    real(x[0:1, :25])
    real(x[1:2])
    assert torch.equal(masked.apply_balancing()["loads"], real.apply_balancing()["loads"])
    assert torch.equal(masked.router.bias, real.router.bias)


def test_eval_and_no_grad_forwards_do_not_touch_statistics():
    block = dyadic_block(make_config())
    x = dyadic_inputs((2, 16, 32), seed=4)
    block.eval()
    block(x)
    block.train()
    with torch.no_grad():
        block(x)
    assert block.apply_balancing() == {}
    assert torch.equal(block.router.bias, torch.zeros(8))
    block(x)  # a training forward with grad does accumulate
    assert block.apply_balancing()["loads"].sum() == 2 * 16 * 2


def test_non_reentrant_checkpointing_counts_tokens_once():
    from torch.utils.checkpoint import checkpoint

    block = dyadic_block(make_config())
    x = dyadic_inputs((2, 16, 32), seed=5).requires_grad_()
    out = checkpoint(lambda t: block(t)[0], x, use_reentrant=False)
    out.sum().backward()
    assert block.apply_balancing()["loads"].sum() == 2 * 16 * 2


@pytest.mark.parametrize("mode", ["loss_free", "aux_loss", "none"])
def test_baseline_modes(mode):
    config = make_config(router_balancing=mode, loss_free_update_rate=0.01)
    block = dyadic_block(config)
    x = dyadic_inputs((2, 50, 32), seed=6)
    _, logits, _ = block(x)
    stats = block.apply_balancing()
    loads = loads_of(torch.sigmoid(logits.double()), torch.zeros(8, dtype=torch.float64), 2)
    assert torch.equal(stats["loads"], loads)
    want = loss_free_balance(loads, torch.zeros(8), 0.01) if mode == "loss_free" else torch.zeros(8)
    torch.testing.assert_close(block.router.bias, want)


# ----------------------------------------------------------------------------------------------- distributed


def _rank_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        block = dyadic_block(make_config())
        x = dyadic_inputs((4, 32, 32), seed=7)
        block(x.chunk(world)[rank])
        stats = block.apply_balancing()
        torch.save({"bias": block.router.bias, "loads": stats["loads"]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process(tmp_path):
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = dyadic_block(make_config())
    single(dyadic_inputs((4, 32, 32), seed=7))
    want = single.apply_balancing()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["loads"], want["loads"])
        assert torch.equal(got["bias"], single.router.bias)


# ----------------------------------------------------------------------------------------------- training hooks


class TinyMoEModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([dyadic_block(make_config(), seed=i) for i in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)[0]
        return x

    def apply_load_balancing(self):
        return {i: block.apply_balancing() for i, block in enumerate(self.blocks)}


def test_optimizer_hook_applies_once_per_step():
    model = TinyMoEModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = register_load_balancing_hook(opt, model)
    x = dyadic_inputs((2, 16, 32), seed=8)
    for _ in range(3):  # three micro-batches of gradient accumulation, one optimizer step
        model(x).sum().backward()
    opt.step()
    assert all(block._loads is None for block in model.blocks)
    assert not torch.equal(model.blocks[0].router.bias, torch.zeros(8))
    handle.remove()
    model(x).sum().backward()
    opt.step()
    assert model.blocks[0]._loads is not None
    with pytest.raises(ValueError):
        register_load_balancing_hook(opt, torch.nn.Linear(2, 2))


def test_trainer_callback_applies_and_logs(tmp_path):
    model = TinyMoEModel()
    model(dyadic_inputs((2, 16, 32), seed=9)).sum().backward()
    callback = LoadBalancingCallback()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state, control = TrainerState(), TrainerControl()
    state.log_history.append({"loss": 1.0, "step": 1})
    callback.on_step_end(args, state, control, model=model)
    assert set(callback.last_stats) == {0, 1} and all(block._loads is None for block in model.blocks)
    logs = {"loss": 1.0}
    callback.on_log(args, state, control, logs=logs)
    want = max(s["max_vio"] for s in callback.last_stats.values())
    assert logs["moe/max_vio_max"] == pytest.approx(want)
    assert state.log_history[-1]["moe/max_vio_max"] == pytest.approx(want)


def naive_max_vio(scores, bias, top_k):
    """MaxVio of a batch counted token by token (an independent loop)."""
    loads = [0] * scores.shape[1]
    for row in (scores + bias).tolist():
        for j in sorted(range(len(row)), key=lambda j: -row[j])[:top_k]:
            loads[j] += 1
    mean = sum(loads) / len(loads)
    return (max(loads) - mean) / mean


def test_balance_floor_routes_fresh_batches_with_the_bias_of_earlier_ones(monkeypatch):
    """`balance_floor` on router scores given here (one layer; 6 batches of 2 rows of 8 tokens): the fit's own MaxVio,
    `floor` (the fixed point of the first `fit` batches routing the fresh batches regrouped by `rows`) and
    `previous` (each fresh batch routed with the fixed point of the one before) against a token-by-token count with
    the biases the float64 oracle gives; the fresh batches are alike in content, so the batch before balances the
    next as well as it balances itself, and a batch skewed onto one expert stays that far off with the fit's bias."""
    gen = torch.Generator().manual_seed(0)
    fit_batches = [torch.rand(16, 4, generator=gen) for _ in range(2)]
    skew = torch.rand(16, 4, generator=gen) * 0.1
    skew[:, 0] += 0.9  # every token prefers expert 0
    fresh = [skew.clone() for _ in range(4)]
    scores = {0: fit_batches + fresh}
    monkeypatch.setattr(balancing, "router_scores_after",
                        lambda run, batches, device: (scores, {"rows": 2, "seq_len": 8, "top_k": 1}))
    out = balancing.balance_floor("unused", rows=[2, 4], batches=6, fit=2, iterations=32, device="cpu")
    zero = torch.zeros(4, dtype=torch.float64)
    fitted = torch.cat(fit_batches).double()
    bias = quantile_fixed_point(fitted, zero, 1, 32)
    assert out["fitted"] == pytest.approx(naive_max_vio(fitted, bias, 1))
    assert out["rows_per_step"] == 2 and out["seq_len"] == 8
    for row, n in zip(out["table"], (16, 32)):
        batches = [torch.cat(fresh).double()[i:i + n] for i in range(0, 64, n)]
        assert row["rows"] == n // 8 and row["batches_x_layers"] == len(batches)
        assert row["floor"] == pytest.approx(np.mean([naive_max_vio(b, bias, 1) for b in batches]))
        previous = [naive_max_vio(b, quantile_fixed_point(a, bias, 1, 32), 1) for a, b in zip(batches, batches[1:])]
        assert row["previous"] == pytest.approx(np.mean(previous))
        assert row["previous"] <= 0.5 < row["floor"]
    with pytest.raises(ValueError, match="fit must lie"):
        balancing.balance_floor("unused", batches=6, fit=6, device="cpu")
