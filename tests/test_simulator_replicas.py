"""The simulator with data-parallel replicas: N=1 unchanged, N=2 serves twice the rate, nothing lost."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pagedllm.serving.router import make_router
from pagedllm.simulator import (
    CostModel,
    SimConfig,
    get_hardware,
    get_model_shape,
    simulate,
    sustained_rate,
    synthetic_trace,
)


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.from_hardware(get_model_shape("opt-13b"), get_hardware("a100-40gb"))


# What the single-engine loop returned before replicas existed (same trace, same config).
BEFORE_REPLICAS = [
    (dict(num_gpu_blocks=200, num_cpu_blocks=100, preemption_mode="swap"),
     {"num_requests": 80, "normalized_latency_s": 0.04034423271941642, "mean_latency_s": 1.7170650552360514,
      "throughput_req_s": 9.75364057832791, "avg_batched_requests": 11.554830278749193, "num_preempted": 37,
      "num_ignored": 0, "duration_s": 8.20206561412114, "num_steps": 353},
     {"token": 0.8681753557015591, "reserved": 0.11700673358345723, "internal": 0.01481791071498359,
      "external": 0.0}),
    (dict(num_gpu_blocks=150),
     {"num_requests": 80, "normalized_latency_s": 0.056667397795037475, "mean_latency_s": 2.2955480827994976,
      "throughput_req_s": 8.878222886563936, "avg_batched_requests": 10.246866037772572, "num_preempted": 84,
      "num_ignored": 0, "duration_s": 9.010812301307489, "num_steps": 386},
     {"token": 0.8711051586068445, "reserved": 0.11449995966829978, "internal": 0.014394881724855679,
      "external": 0.0}),
]


@pytest.mark.parametrize("options, row, waste", BEFORE_REPLICAS)
def test_one_replica_is_the_old_simulation(cost, options, row, waste) -> None:
    trace = synthetic_trace("alpaca", 80, 30.0, seed=3, n=2)  # parallel samples, preemption
    result = simulate(trace, cost, SimConfig(**options))
    assert {k: result.row()[k] for k in row} == row  # exactly, not approximately
    assert result.kv_waste["fraction_of_used"] == waste
    assert result.num_replicas == 1 and result.router_stats == {}


def test_two_replicas_sustain_twice_the_rate(cost) -> None:
    # A small pool puts the knee of Figure 12's curve at ~10 req/s for one replica (one:
    # 10 req/s, two: 20 req/s under the bar). Near the knee, latency varies from one trace sample
    # to another (the 2-replica trace is a different sample), so the seed is fixed and each
    # replica gets as many requests as the single one.
    rates = [4, 6, 8, 10, 12, 14]
    config = SimConfig(num_gpu_blocks=80)
    one = [simulate(synthetic_trace("alpaca", 80, r, seed=4), cost, config).normalized_latency_s for r in rates]
    two_config = dataclasses.replace(config, num_replicas=2, router="round_robin")
    two = [simulate(synthetic_trace("alpaca", 160, 2 * r, seed=4), cost, two_config).normalized_latency_s
           for r in rates]
    slo = 1.25 * one[0]
    sustained_one = sustained_rate(rates, one, slo)
    sustained_two = sustained_rate([2 * r for r in rates], two, slo)
    assert 0 < sustained_one < rates[-1]  # the knee is inside the sweep
    assert 1.5 <= sustained_two / sustained_one <= 2.5
    assert two[rates.index(sustained_one)] <= slo < one[-1]


@pytest.mark.parametrize("policy", ["prefix", "round_robin", "least_loaded"])
def test_every_request_finishes_on_some_replica(cost, policy) -> None:
    trace = synthetic_trace("alpaca", 60, 200.0, seed=1)  # a burst: replicas fill up, some preempt
    result = simulate(trace, cost, SimConfig(num_gpu_blocks=60, num_replicas=3, router=policy))
    assert result.num_requests == 60 and result.num_ignored == 0 and result.num_replicas == 3
    requests = result.router_stats["requests"]
    assert sum(requests.values()) == 60 and set(requests) == {0, 1, 2}
    assert sum(result.router_stats["decisions"].values()) == 60
    assert max(requests.values()) - min(requests.values()) <= 10  # balanced
    assert result.stats["num_gpu_blocks"] == 3 * 60  # counters summed over the replicas
    assert set(result.kv_waste["fraction_of_used"]) == {"token", "reserved", "internal", "external"}


def test_a_router_object_can_be_passed(cost) -> None:
    router = make_router("least_loaded", 16)
    trace = synthetic_trace("alpaca", 20, 50.0, seed=2)
    result = simulate(trace, cost, SimConfig(num_gpu_blocks=100, num_replicas=2), router=router)
    assert result.num_requests == 20 and router.stats()["decisions"] == {"least_loaded": 20}
    with pytest.raises(ValueError, match="num_replicas"):
        simulate(trace, cost, SimConfig(num_replicas=0))


def test_simulate_cli_replicas(tmp_path, capsys) -> None:
    from pagedllm.entrypoints.simulate_cli import add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "sim.json"
    args = parser.parse_args(["simulate", "--trace", "alpaca", "--rate", "20", "--num-requests", "20",
                              "--num-gpu-blocks", "100", "--replicas", "2", "--router", "round_robin",
                              "--json", str(out)])
    assert args.func(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["replicas"] == 2 and row["num_requests"] == 20
    assert row["router_stats"]["requests"] == {"0": 10, "1": 10}
    assert "2 replicas" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--router", "random"])
