"""Which launcher's variables give the rank before the process group exists, and the
process group's answer after (export/identity.py): a rank no source gives is absent,
never a guessed 0."""

from __future__ import annotations

import pytest

from otel_training.export.identity import ProcessInfo, from_environment, from_process_group

RANK_KEYS = ("training.rank", "training.local_rank", "training.world_size")


def _ids(info: ProcessInfo) -> tuple:
    return info.rank, info.local_rank, info.world_size


@pytest.mark.parametrize("environ, expected", [
    ({}, (0, 0, 1)),  # a single process
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, (3, 1, 4)),  # torchrun
    # torchrun's variables win over the Slurm task's (torchrun inside srun)
    ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (5, 1, 8)),
    # Lightning's child: LOCAL_RANK, WORLD_SIZE, NODE_RANK, no RANK
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, (None, 1, 2)),
    # ... also inside a single Slurm task: Slurm's variables name the launcher's task, not this rank
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (None, 1, 2)),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, (None, None, None)),  # rank still to come
    ({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, (0, 0, 1)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, (2, 0, 4)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},
     (2, None, 4)),
    ({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4"}, (3, 1, 4)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 0, 1)),
    ({"RANK": "x", "WORLD_SIZE": "2"}, (None, None, 2)),  # unreadable: not a 0
])
def test_launcher_variables_precedence(environ, expected):
    info = from_environment(environ, "h")
    assert _ids(info) == expected
    attrs = info.metric_attributes()
    for key, value in zip(RANK_KEYS, expected):
        if info.distributed:
            assert attrs.get(key) == value  # absent (None) when not known
        else:
            assert key not in attrs
    assert set(info.missing) == {k for k, v in zip(RANK_KEYS, expected) if v is None}


def test_a_spawned_child_trusts_no_inherited_rank():
    # mp.spawn's children inherit the parent's variables: they name the parent.
    inherited = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    assert _ids(from_environment(inherited, "h", spawned=True)) == (None, None, None)
    assert _ids(from_environment({}, "h", spawned=True)) == (0, 0, 1)


class _Group:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world


def test_the_process_group_wins():
    # Lightning's rank 0 set its variables after start-up; the group names the rank.
    info = from_process_group(_Group(0, 2), {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "0"}, "h")
    assert (_ids(info), info.missing) == ((0, 0, 2), ())
    # A local rank from variables of another world is none of this group's.
    info = from_process_group(_Group(1, 2), {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, "h")
    assert _ids(info) == (1, None, 2)
    assert info.missing == ("training.local_rank",)
    assert _ids(from_process_group(_Group(1, 2), {"LOCAL_RANK": "1"}, "h", spawned=True)) == (1, None, 2)
    assert _ids(from_process_group(_Group(0, 1), {}, "h")) == (0, 0, 1)


def test_init_process_group_wrap_is_a_removable_handle(instrumented, tmp_path):
    import torch.distributed as dist
    import torch.distributed.device_mesh as mesh

    owners = (dist, dist.distributed_c10d, mesh)  # each name torch calls it by
    originals = tuple(owner.init_process_group for owner in owners)
    tel = instrumented()
    assert all(owner.init_process_group is not f for owner, f in zip(owners, originals))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert tel.runtime.info.source == "process group"  # learned when the call returned
        assert _ids(tel.runtime.info) == (0, 0, 1)
    finally:
        dist.destroy_process_group()
    tel.uninstrument()
    assert all(owner.init_process_group is f for owner, f in zip(owners, originals))
