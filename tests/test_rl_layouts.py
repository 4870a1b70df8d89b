"""RL trainer layouts, pure logic: which layouts the config takes and who scores exact log-probabilities,
and the first update's old log-probabilities taken from its own forward (the trainers' exact mode under
tensor or expert parallelism) are bit for bit the ones a separate pass of that forward writes into the
rows. The layouts themselves run in tests/test_rl_layouts_e2e.py."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.unit


def _cfg(*args):
    from stalwart.config import load
    from stalwart.config.rl import RLConfig

    return load(RLConfig, None, ["--rl.prompts_per_step", "8", *args])


def test_layouts_and_who_scores_exact_logprobs():
    from stalwart.config import ConfigError

    assert not _cfg("--workers.trainers", "2", "--parallelism.dp_shard", "2").exact_on_trainers()
    assert _cfg("--workers.trainers", "2", "--parallelism.tp", "2").exact_on_trainers()
    assert _cfg("--workers.trainers", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2").exact_on_trainers()
    assert not _cfg("--workers.trainers", "2", "--parallelism.tp", "2", "--rl.logprobs", "engine",
                    "--rl.mode", "async").exact_on_trainers()
    # tp ranks share their data-parallel rank's groups: 8 prompts over 4 trainers at tp=2 is 4 per rank.
    _cfg("--workers.trainers", "4", "--parallelism.tp", "2", "--rl.updates_per_step", "4")
    for args, words in [
        (["--workers.trainers", "2", "--parallelism.tp", "2", "--rl.mode", "async", "--rl.logprobs", "exact"],
         "needs rl.mode = sync"),
        (["--workers.trainers", "2", "--parallelism.pp", "2"], "set parallelism.pp and cp to 1"),
        (["--workers.trainers", "2", "--parallelism.cp", "2"], "set parallelism.pp and cp to 1"),
        (["--workers.trainers", "3", "--parallelism.tp", "2"], "parallelism.tp (2) must divide workers.trainers (3)"),
        (["--workers.trainers", "6", "--parallelism.tp", "2"], "multiple of workers.trainers / parallelism.tp (6 / 2)"),
        (["--workers.trainers", "4", "--parallelism.tp", "2", "--rl.updates_per_step", "8"], "(2 x 8)"),
        (["--workers.trainers", "2", "--parallelism.tp", "2", "--workers.balance", "adaptive"],
         "workers.balance = adaptive"),
        (["--workers.generator_tp", "2", "--workers.balance", "adaptive"], "set workers.generator_tp 1"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            _cfg(*args)


def test_the_first_updates_own_old_logprobs_are_the_scored_ones_bit_for_bit():
    from stalwart.rl.objective import GRPOObjective, token_logprobs
    from stalwart.rl.rollout import ADVANTAGE, CHANNELS, MASK, OLD_LOGP, ON_POLICY, TOKEN, WEIGHT

    torch.manual_seed(0)
    rows = np.zeros((4, 6, CHANNELS))
    rows[..., TOKEN] = np.random.default_rng(0).integers(0, 16, (4, 6))
    rows[:, 2:, MASK] = 1.0
    rows[..., ADVANTAGE] = np.array([1.0, -1.0, 0.5, -0.5])[:, None]
    rows[..., WEIGHT] = 0.1
    rows[..., ON_POLICY] = 1.0
    rows[..., OLD_LOGP] = -3.0  # the engine's numbers, off by more than rounding
    logits = torch.randn(4, 6, 16, requires_grad=True)
    scored = rows.copy()  # what the trainers' scoring pass writes: this forward's log-probabilities
    with torch.no_grad():
        lp = token_logprobs(logits, torch.from_numpy(rows[..., TOKEN]).long()).double().numpy()
    scored[..., OLD_LOGP] = np.where(rows[..., MASK] > 0, lp, rows[..., OLD_LOGP])

    own = GRPOObjective(0.2, 0.28, "token-mean", 0.0, own_old=True)
    loss = own(logits, torch.from_numpy(rows))
    (grad,) = torch.autograd.grad(loss, logits)
    plain = GRPOObjective(0.2, 0.28, "token-mean", 0.0)
    ref = plain(logits, torch.from_numpy(scored))
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert torch.equal(loss, ref) and torch.equal(grad, ref_grad)
    assert float(own.stats[3]) == float(own.stats[4]) == 0.0  # no mismatch: old is new, bit for bit
    assert float(GRPOObjective(0.2, 0.28, "token-mean", 0.0)(logits, torch.from_numpy(rows)).detach()) != float(loss.detach())
