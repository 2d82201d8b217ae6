"""Small, pure helpers over ``torch.fx`` graphs: finding nodes, metadata, views, dumps."""

from .nodes import (
    COLLECTIVE_OPS,
    WAIT_OP,
    find_node,
    get_output,
    is_all_reduce,
    is_comm_node,
    is_wait_node,
    set_fake_val,
    tensor_bytes,
)
from .views import dump_graphs_to_files, graph_summary, node_records, print_graph_summary, to_networkx

__all__ = [
    "COLLECTIVE_OPS", "WAIT_OP", "find_node", "get_output", "is_all_reduce", "is_comm_node",
    "is_wait_node", "set_fake_val", "tensor_bytes", "dump_graphs_to_files", "graph_summary", "node_records",
    "print_graph_summary", "to_networkx",
]
