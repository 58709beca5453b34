"""DTensors are compared only across the ranks that hold replicas of the same shard (Replicate mesh dims)."""
import json
import textwrap

from launch_helpers import run_python

# A process of its own (forked by the session's zygote): the fake process group is process-global state; it
# plays each of the 4 ranks in turn.
SCRIPT = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    from distcheck.rank.checks.replicas import replica_key

    keys = {}
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = torch.zeros(8, 8)
        keys[rank] = [repr(replica_key(distribute_tensor(t, mesh, [Replicate(), Shard(0)]))),
                      repr(replica_key(distribute_tensor(t, mesh, [Replicate(), Replicate()]))),
                      repr(replica_key(t))]
        dist.destroy_process_group()
    print(json.dumps(keys))
""")


def test_replicate_dims_define_the_replica_groups(tmp_path):
    script = tmp_path / "replica_keys.py"
    script.write_text(SCRIPT)
    out = run_python([str(script)], timeout=120)
    assert out.returncode == 0, out.stderr
    keys = {int(r): k for r, k in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    # [Replicate, Shard(0)] on a (dp=2, tp=2) mesh: ranks with the same tp coordinate hold the same shard.
    # Mesh [[0, 1], [2, 3]]: tp coordinate 0 = ranks 0, 2; tp coordinate 1 = ranks 1, 3.
    assert keys[0][0] == keys[2][0] and keys[1][0] == keys[3][0] and keys[0][0] != keys[1][0]
    # Fully replicated: one replica group over the whole mesh.
    assert len({keys[r][1] for r in range(4)}) == 1
    # A plain tensor: compared across the whole group.
    assert all(keys[r][2] == "None" for r in range(4))
