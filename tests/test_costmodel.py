"""The shared cost model: roofline arithmetic, collective volumes, runtime margins."""

import pytest

from autotune import costmodel as cm
from autotune.catalog.gpus import GPUS
from autotune.config import Cluster

H100 = GPUS["h100-80gb"]


def test_roofline_matches_a_hand_calculation():
    cluster = Cluster(num_gpus=8, gpu=H100)
    tokens_per_mb = 4096
    work = cm.StepWork(flops_per_gpu=1e15, tokens_per_step=tokens_per_mb * 8, num_microbatches=1,
                       allgather_bytes_per_gpu=16e9, reduce_scatter_bytes_per_gpu=0.0, num_fsdp_units=None)
    step = cm.estimate_step_time(work, cluster)
    eff = cm.MATMUL_EFFICIENCY['h100-80gb'] * tokens_per_mb / (tokens_per_mb + cm.HALF_EFFICIENCY_TOKENS)
    compute = 1e15 / (989e12 * eff)
    comm = 16e9 * 7 / 8 / (450e9 * cm.INTRA_NODE_BUS_EFFICIENCY)
    assert step.compute_s == pytest.approx(compute)
    assert step.comm_s == pytest.approx(comm)
    # Comm (~39 ms) is shorter than compute (~2 s) and no unit term was given: fully hidden.
    assert step.exposed_comm_s == 0.0
    assert step.seconds == pytest.approx(compute)
    assert step.tokens_per_sec == pytest.approx(tokens_per_mb * 8 / compute)
    assert step.mfu == pytest.approx(1e15 / (compute * 989e12))
    assert step.basis.startswith("estimated: roofline on h100-80gb")


def test_comm_beyond_compute_is_exposed_and_units_expose_first_and_last():
    cluster = Cluster(num_gpus=8, gpu=H100)
    base = dict(flops_per_gpu=2e13, tokens_per_step=8 * 512, allgather_bytes_per_gpu=20e9,
                reduce_scatter_bytes_per_gpu=20e9)
    step = cm.estimate_step_time(cm.StepWork(**base), cluster)
    assert step.comm_s > step.compute_s
    assert step.exposed_comm_s == pytest.approx(step.comm_s - step.compute_s)
    with_units = cm.estimate_step_time(cm.StepWork(**base, num_fsdp_units=10), cluster)
    assert with_units.exposed_comm_s == pytest.approx(step.exposed_comm_s + step.comm_s / 10)
    assert with_units.seconds > step.seconds


def test_multi_node_rings_run_at_nic_bandwidth():
    work = cm.StepWork(flops_per_gpu=1e12, tokens_per_step=16 * 4096, allgather_bytes_per_gpu=1e10)
    one = cm.estimate_step_time(work, Cluster(num_gpus=16, num_nodes=1, gpu=H100))
    two = cm.estimate_step_time(work, Cluster(num_gpus=16, num_nodes=2, gpu=H100))
    assert two.comm_s / one.comm_s == pytest.approx(
        H100.intra_node_gbps * cm.INTRA_NODE_BUS_EFFICIENCY / (H100.inter_node_gbps * cm.INTER_NODE_BUS_EFFICIENCY))
    assert "2 nodes" in two.basis


def test_single_gpu_has_no_collective_time():
    step = cm.estimate_step_time(cm.StepWork(flops_per_gpu=1e12, tokens_per_step=4096,
                                             allgather_bytes_per_gpu=1e10), Cluster(num_gpus=1, gpu=H100))
    assert step.comm_s == 0.0


def test_offload_adds_pcie_copies_and_a_cpu_adam_step():
    cluster = Cluster(num_gpus=8, gpu=H100)
    plain = cm.StepWork(flops_per_gpu=1e15, tokens_per_step=8 * 4096)
    offload = cm.StepWork(flops_per_gpu=1e15, tokens_per_step=8 * 4096, host_to_device_bytes=5e9,
                          device_to_host_bytes=5e9, cpu_optimizer_params=10**9)
    a, b = cm.estimate_step_time(plain, cluster), cm.estimate_step_time(offload, cluster)
    assert b.offload_s == pytest.approx(10e9 / (cm.host_link_gbps(H100) * 1e9))
    assert b.cpu_optimizer_s == pytest.approx(8 * 10**9 / cm.CPU_ADAM_PARAMS_PER_S_PER_NODE)
    assert b.seconds > a.seconds + b.cpu_optimizer_s * 0.99


def test_collective_bytes_counts_fsdp2_passes():
    vol = cm.collective_bytes(block_params=100, num_blocks=4, root_params=50, param_bytes=2,
                              reshard_after_forward=True, num_microbatches=3)
    # forward gathers blocks + root, backward the blocks again; fp32 reduce-scatter of all.
    assert vol.allgather_bytes == 3 * (400 * 2 * 2 + 50 * 2)
    assert vol.reduce_scatter_bytes == 3 * 450 * 4
    kept = cm.collective_bytes(block_params=100, num_blocks=4, root_params=50, param_bytes=2,
                               reshard_after_forward=False)
    assert kept.allgather_bytes == 450 * 2
    h2d, d2h = cm.offload_bytes(block_params=100, num_blocks=4, root_params=50, num_gpus=2)
    assert (h2d, d2h) == (850 * 4 / 2, 450 * 4 / 2)


def test_fsdp_step_work_assembles_volumes_and_offload():
    sizes = dict(flops_per_gpu=1e12, model_flops_per_gpu=9e11, tokens_per_gpu_step=1000, num_gpus=4,
                 block_params=100, num_blocks=4, root_params=50, param_bytes=2, num_microbatches=2)
    plain = cm.fsdp_step_work(**sizes)
    assert plain.tokens_per_step == 4000 and plain.num_fsdp_units == 5
    assert plain.allgather_bytes_per_gpu == cm.collective_bytes(
        block_params=100, num_blocks=4, root_params=50, param_bytes=2, num_microbatches=2).allgather_bytes
    assert (plain.host_to_device_bytes, plain.cpu_optimizer_params) == (0.0, 0)
    offload = cm.fsdp_step_work(**sizes, cpu_offload=True)
    assert offload.cpu_optimizer_params == 450 // 4 + 1  # ceil: the first ranks hold the remainder
    assert offload.device_to_host_bytes == 2 * 450 * 4 / 4


def test_hsdp_moves_the_gather_traffic_onto_the_node_links():
    """On 8 nodes, sharding within a node leaves only the gradient shards' all-reduce on the
    inter-node links: far less communication time than sharding over all 64 GPUs; groups of
    whole nodes keep all their traffic inter-node."""

    cluster = Cluster(num_gpus=64, num_nodes=8)
    work = cm.fsdp_step_work(flops_per_gpu=1e15, model_flops_per_gpu=1e15, tokens_per_gpu_step=4096,
                                    num_gpus=64, block_params=800_000_000, num_blocks=80,
                                    root_params=2_000_000_000, param_bytes=2)
    fsdp = cm.estimate_step_time(work, cluster)
    node = cm.estimate_step_time(work, cluster, shard_group_size=8)
    intra, inter = cm.hsdp_comm_seconds(work, cluster, shard_group_size=8)
    assert intra > 0 and inter > 0 and node.comm_s == pytest.approx(intra + inter)
    assert node.comm_s < fsdp.comm_s
    assert cm.hsdp_comm_seconds(work, cluster, shard_group_size=32)[0] == 0.0
    single = Cluster(num_gpus=8)
    assert cm.estimate_step_time(work, single, shard_group_size=8).comm_s == \
        cm.estimate_step_time(work, single).comm_s  # one group of every GPU is plain FSDP
