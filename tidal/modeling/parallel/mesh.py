"""A ("dp", "tp") DeviceMesh over an executor's own ranks, not the whole world.

`init_device_mesh` spans the whole world, and `DeviceMesh(device_type, mesh)` creates every
subgroup with `new_group`, which every rank of the world must call in the same order (non-members
included). An executor's `init` runs on its own ranks only, so the default here builds the mesh
from groups that only members create (`members_only=True`):

- this rank creates exactly two groups, its tp row then its dp column, with
  `use_local_synchronization=True`: only the members of a group take part in creating it;
- such a group is named by hashing its ranks together with the number of process groups this rank
  already holds, so all members must hold the same number of groups when they get here. That holds
  when every rank built the same groups before (tidal/controller/world.py creates every executor group on
  every rank) and the members did the same things since. Pass `parent` (a group of exactly these
  ranks, e.g. the executor's group) to check it: a mismatch raises instead of hanging in rendezvous;
- hashed names do not advance the world's group counter, so later world-wide `new_group` calls stay
  paired across ranks.

`members_only=False` is the world-synchronised alternative: every rank of the world calls
`build_mesh` with the same arguments in the same order (e.g. while the controller builds the
world), and non-members get None back.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def mesh_ranks(ranks: Sequence[int], *, tp: int) -> torch.Tensor:
    """Global ranks as a [dp, tp] grid, row-major: rank (d, t) is ranks[d * tp + t]."""
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide the {len(ranks)} ranks {list(ranks)}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {list(ranks)} contain duplicates")
    return torch.tensor(list(ranks), dtype=torch.int).view(len(ranks) // tp, tp)


def _group_count() -> int:
    # c10d keeps no public count of the groups a rank holds; this is the number that goes into a
    # hashed group name (distributed_c10d._hash_ranks_to_str).
    return len(dist.distributed_c10d._world.pg_names)


def check_group_counts(ranks: Sequence[int], parent: dist.ProcessGroup | None) -> None:
    """Before members-only groups: every rank of `parent` (a group of exactly `ranks`) holds as many groups, else
    their hashed names would not pair up (a named error instead of a hang in rendezvous). None: unchecked."""
    if parent is None:
        return
    counts = [None] * dist.get_world_size(parent)
    dist.all_gather_object(counts, _group_count(), group=parent)
    if len(set(counts)) != 1:
        raise RuntimeError(f"mesh ranks {list(ranks)} hold different numbers of process groups {counts}; "
                           f"members-only groups would not pair up (see tidal/modeling/parallel/mesh.py)")


def build_mesh(*, ranks: Sequence[int], tp: int, device_type: str = "cpu", members_only: bool = True,
               parent: dist.ProcessGroup | None = None, names: tuple[str, str] = ("dp", "tp")) -> DeviceMesh | None:
    """A 2-D DeviceMesh named ("dp", "tp") (or `names`) over `ranks` (row-major, see `mesh_ranks`).

    members_only=True: call on the ranks in `ranks` only (all of them). False: call on every rank
    of the world; ranks outside `ranks` get None.
    """
    grid_DT = mesh_ranks(ranks, tp=tp)
    rank = dist.get_rank()
    if not members_only:
        mesh = DeviceMesh(device_type, grid_DT, mesh_dim_names=names)
        return mesh if rank in ranks else None
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the mesh ranks {list(ranks)}; with members_only=True "
                         f"only the mesh's own ranks call build_mesh")
    check_group_counts(ranks, parent)
    d, t = (grid_DT == rank).nonzero()[0].tolist()
    # the same order on every member: tp row first, then dp column
    tp_group = dist.new_group(grid_DT[d].tolist(), use_local_synchronization=True)
    dp_group = dist.new_group(grid_DT[:, t].tolist(), use_local_synchronization=True)
    return DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=grid_DT, mesh_dim_names=names)


def build_pipeline_mesh(*, ranks: Sequence[int], tp: int, pp: int, device_type: str = "cpu",
                        parent: dist.ProcessGroup | None = None) -> DeviceMesh:
    """A 3-D ("dp", "pp", "tp") mesh over `ranks`, row-major (rank (d, s, t) is ranks[(d * pp + s) * tp + t]),
    from members-only groups as `build_mesh` makes them: this rank's tp row, pp column, dp column, in that order."""
    grid_DST = mesh_ranks(ranks, tp=tp * pp).view(-1, pp, tp)
    check_group_counts(ranks, parent)
    d, s, t = (grid_DST == dist.get_rank()).nonzero()[0].tolist()
    tp_group = dist.new_group(grid_DST[d, s].tolist(), use_local_synchronization=True)
    pp_group = dist.new_group(grid_DST[d, :, t].tolist(), use_local_synchronization=True)
    dp_group = dist.new_group(grid_DST[:, s, t].tolist(), use_local_synchronization=True)
    return DeviceMesh.from_group([dp_group, pp_group, tp_group], device_type, mesh=grid_DST,
                                 mesh_dim_names=("dp", "pp", "tp"))
