"""Names of the collectives distcheck knows, shared by the tracer (what to wrap) and the stack and trace
analysis (what a rank is blocked in). Pure data: importing it costs nothing."""
from __future__ import annotations

# torch.distributed / distributed_c10d entry points.
C10D_OPS = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
    "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list",
)
# torch.distributed._functional_collectives (DTensor, torch.compile-friendly user code).
FUNCOL_OPS = (
    "broadcast", "all_reduce", "all_gather_single", "all_gather_single_autograd", "reduce_scatter_single",
    "reduce_scatter_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_reduce_coalesced", "all_gather_single_coalesced",
    "reduce_scatter_single_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "all_to_all_single_autograd", "permute_tensor",
    "all_reduce_inplace", "all_to_all_inplace", "all_gather_inplace", "reduce_scatter_inplace",
)
# Point-to-point: matched by peer, not by position in a group.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})
# Not matched by position in a process group: point-to-point ops, and batches of them (their peers are per item).
PEER_OPS = P2P_OPS | {"batch_isend_irecv"}
