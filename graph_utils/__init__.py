"""Small helpers over ``torch.fx`` graphs: finding nodes, metadata, views, dumps, a graph as plain
data and back (``graph_record``, what a kept trace stores), and the optimizer analyses
several passes share (``fused_optimizer``, ``foreach_chains``)."""

from .nodes import (
    COLLECTIVE_OPS,
    WAIT_OP,
    comm_group_name,
    eliminate_dead_nodes,
    find_node,
    get_output,
    is_all_reduce,
    is_comm_node,
    is_wait_node,
    node_order,
    set_fake_val,
    tensor_bytes,
    wait_of,
    waited_collective,
)
from .duplicate_nodes import merge_duplicate_nodes
from .dumps import DumpOptions, dumping, record_stage, recording_stages, request_dump
from .lazy import lazy_graph_module, lazy_graph_modules, make_lazy
from .views import dump_graphs_to_files, graph_summary, node_records, to_networkx

__all__ = [
    "DumpOptions", "dumping", "record_stage", "recording_stages", "request_dump",
    "COLLECTIVE_OPS", "WAIT_OP", "comm_group_name", "eliminate_dead_nodes", "find_node", "get_output", "is_all_reduce",
    "is_comm_node", "is_wait_node", "merge_duplicate_nodes", "node_order", "lazy_graph_module", "lazy_graph_modules", "make_lazy",
    "set_fake_val", "tensor_bytes", "wait_of", "waited_collective", "dump_graphs_to_files", "graph_summary",
    "node_records", "to_networkx",
]
