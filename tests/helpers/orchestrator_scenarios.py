"""Hypothesis strategy of random orchestrator scenarios (config, instances, faults, tails); shared
by the property tests of the orchestrator."""

from hypothesis import strategies as st

from dora_megatron.config.orchestrator import OrchestratorConfig


@st.composite
def scenarios(draw, modes=("sync", "one_step_off", "partial", "dora")):
    mode = draw(st.sampled_from(modes))
    tbs = draw(st.integers(1, 5))
    cap_after = draw(st.integers(1, 4))
    cfg = OrchestratorConfig(
        mode=mode, tbs=tbs, rbs=tbs + draw(st.integers(0, 2 * tbs)), max_staleness=draw(st.integers(0, 4)),
        group_size=draw(st.integers(1, 4)), kv_high_watermark=draw(st.sampled_from([0.5, 0.9, 1.0])),
        rebalance_interval_s=draw(st.sampled_from([0.0, 1.0, 5.0])),
        imbalance_ratio=draw(st.sampled_from([1.0, 1.5, 3.0, 100.0])), legacy_fill=draw(st.booleans()),
        cap_before_rebalance=cap_after + draw(st.integers(0, 4)), cap_after_rebalance=cap_after,
        max_migrations_per_rebalance=draw(st.sampled_from([0, 0, 1, 3])),
        repartition=draw(st.sampled_from([True, True, True, False])), dual_version=draw(st.booleans()))
    return dict(cfg=cfg, n_instances=draw(st.integers(1, 6)), seed=draw(st.integers(0, 2**31)),
                fail_prob=draw(st.sampled_from([0.0, 0.05, 0.2])), join_prob=draw(st.sampled_from([0.0, 0.1])),
                tail_alpha=draw(st.sampled_from([1.1, 1.5, 3.0])), steps=draw(st.integers(2, 12)),
                migration_fail_prob=draw(st.sampled_from([0.0, 0.0, 0.2])))
