"""Layouts as columns (attune.spec.columns): a batch round-trips every field, None included."""

import numpy as np
import pytest

from attune.errors import LayoutError
from attune.spec.columns import FIELDS, KINDS, NONE_INT, LayoutColumns
from attune.spec.layout import Layout


def _layouts():
    return [
        Layout(tp=2, pp=4, dp=1, sp=True, first=16, last=14, recompute_granularity="full", recompute_method="block",
               recompute_num_layers=12, max_tokens_per_gpu=8192),
        Layout(tp=1, pp=1, dp=8, moe_capacity_factor=1.25, recompute_granularity="selective",
               recompute_modules=("core_attn", "mlp"), offload_modules=("attn_norm",), fp8_format="e4m3",
               fp8_recipe="blockwise"),
        Layout(),
    ]


def test_round_trip_every_field():
    lays = _layouts()
    cols = LayoutColumns.from_layouts(lays)
    assert len(cols) == 3
    assert cols.layouts() == lays
    assert set(cols.columns()) == set(FIELDS)


def test_encoding_of_none():
    cols = LayoutColumns.from_layouts(_layouts())
    assert KINDS["first"] == "opt_int" and cols["first"].tolist() == [16, NONE_INT, NONE_INT]
    assert np.isnan(cols["moe_capacity_factor"][0]) and cols["moe_capacity_factor"][1] == 1.25
    assert cols["tp"].dtype == np.int64 and cols["sp"].dtype == np.bool_


def test_take_and_defaults():
    cols = LayoutColumns({"tp": [1, 2, 4], "dp": np.array([8, 4, 2])})
    assert cols.layout(2) == Layout(tp=4, dp=2)
    sub = cols.take(cols["tp"] > 1)
    assert [lay.tp for lay in sub.layouts()] == [2, 4]


def test_bad_columns_are_one_line_errors():
    with pytest.raises(LayoutError, match="not Layout fields"):
        LayoutColumns({"tpp": [1]})
    with pytest.raises(LayoutError, match="one length"):
        LayoutColumns({"tp": [1, 2], "pp": [1]})
