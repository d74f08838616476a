"""Graph-IR passes, run in order by the driver: constant folding, sums of one-hot rows
collapsed, constant scales out of sums of products, reductions over a few elements spelt out
as pointwise, CSE, dead-code elimination, a scatter into
zeros added to a tensor made a scatter into that tensor, library scatters into a buffer nothing
else reads in place."""
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .fold import fold_constants
from .inplace_externs import scatter_in_place
from .one_hot import collapse_one_hot_sums
from .scatter_addends import scatter_into_addends
from .scales import hoist_scales
from .unroll_reductions import unroll_small_reductions

PIPELINE = (("fold", fold_constants), ("one_hot", collapse_one_hot_sums), ("scales", hoist_scales),
            ("unroll", unroll_small_reductions), ("cse", eliminate_common_subexpressions), ("dce", eliminate_dead_code), ("addends", scatter_into_addends),
            ("inplace", scatter_in_place))


def run_passes(graph):
    for _, fn in PIPELINE:
        graph = fn(graph)
    return graph


__all__ = ["run_passes", "fold_constants", "collapse_one_hot_sums", "hoist_scales", "eliminate_common_subexpressions", "eliminate_dead_code",
           "scatter_into_addends", "scatter_in_place", "unroll_small_reductions"]
