"""What a served model is deployed with (mha_ep/serve/options.py): the resources a replica asks Ray for, the
options' checks and the cluster's capacity, as sentences; no Ray."""

from __future__ import annotations

import pytest

from mha_ep.serve.cluster import last_line
from mha_ep.serve.options import ServeOptions, capacity_problem, replica_resources


def test_a_replica_asks_for_one_gpu_when_the_model_runs_on_one():
    assert replica_resources(ServeOptions("m.onnx")).actor_options() == {"num_cpus": 1.0, "num_gpus": 0}
    cuda = replica_resources(ServeOptions("m.onnx", providers="cuda"))
    assert cuda.num_gpus == 1 and cuda.reason == "the CUDA provider runs on a GPU: one per replica"
    assert replica_resources(ServeOptions("m.onnx", backend="cuda")).reason == "the cuda backend runs on a GPU: one per replica"
    given = replica_resources(ServeOptions("m.onnx", providers="cuda", gpus_per_replica=0.5, cpus_per_replica=2))
    assert (given.num_cpus, given.num_gpus, given.reason) == (2, 0.5, "gpus_per_replica was given")
    assert ServeOptions("m.onnx", providers="cuda").provider_list() == ["CUDAExecutionProvider", "CPUExecutionProvider"]


@pytest.mark.parametrize("change, message", [
    ({"backend": "gpu"}, "backend must be one of ('auto', 'reference', 'cuda'), got 'gpu'"),
    ({"providers": "rocm"}, "providers must be one of ('cpu', 'cuda'), got 'rocm'"),
    ({"max_batch": 0}, "max_batch must be at least 1 (1: batching off), got 0"),
    ({"batch_wait_ms": -1}, "batch_wait_ms must be 0 or more, got -1"),
    ({"route_prefix": "bert"}, "route_prefix must be a path starting with '/', got 'bert'"),
])  # fmt: skip
def test_an_option_out_of_range_is_named_with_what_it_takes(change, message):
    with pytest.raises(ValueError) as caught:
        ServeOptions("m.onnx", **change)
    assert str(caught.value) == f"mha_ep.serve: {message}"


def test_a_replica_holds_enough_requests_for_its_batches():
    assert ServeOptions("m.onnx", max_batch=1).ongoing() == 32 and ServeOptions("m.onnx", max_batch=16).ongoing() == 64
    assert ServeOptions("m.onnx", max_ongoing=3).ongoing() == 3
    assert ServeOptions("m.onnx", max_batch=4, batch_wait_ms=1.5).user_config() == {"max_batch": 4, "batch_wait_ms": 1.5}


def test_a_cluster_without_the_replicas_resources_is_refused_before_serve_would_wait_for_them():
    assert capacity_problem(ServeOptions("m.onnx", providers="cuda", replicas=2), {"CPU": 16, "GPU": 2}) == ""
    assert capacity_problem(ServeOptions("m.onnx", providers="cuda", replicas=2), {"CPU": 16, "GPU": 1}) == (
        "mha_ep.serve: 2 replica(s) x 1 GPU (the CUDA provider runs on a GPU: one per replica) is more than the 1 "
        "GPU the Ray cluster has; lower replicas, or set gpus_per_replica / cpus_per_replica")
    assert "x 1 CPU" in capacity_problem(ServeOptions("m.onnx", replicas=3), {"CPU": 2})
    assert capacity_problem(ServeOptions("m.onnx", replicas=3, cpus_per_replica=0), {"CPU": 2}) == ""


def test_a_failed_replicas_traceback_is_cut_to_its_exception():
    assert last_line("Traceback (most recent call last):\n  File x\nFileNotFoundError: no ONNX model at 'm'\n\n") == \
        "FileNotFoundError: no ONNX model at 'm'"  # fmt: skip
    assert last_line("") == ""
