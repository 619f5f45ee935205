"""Metadata filters: evaluate() equals a plain-Python reference over the rows for random filters of every
operator; errors name the column or path and what is valid; metadata JSON becomes typed columns."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pytest

from puma.index.filters import (
    JSON_TYPE,
    MAX_DEPTH,
    MAX_NODES,
    OPS,
    FilterError,
    MetadataError,
    check_filter,
    column_types,
    describe_columns,
    evaluate,
    metadata_columns,
    parse_filter,
)

TYPES = {"category": "string", "brand": "string", "size": "string", "price": "number", "stock": "number",
         "in_stock": "boolean", "tags": "json"}
VALUES = {
    "category": ["boots", "hat", "scarf", "coat", "sandale à talon"],
    "brand": ["acme", "nord", "zeta", "ösel"],
    "size": ["S", "M", "L"],
    "price": [9.99, 10.0, 25.5, 49.99, 50.0, 75.0, 120.0],
    "stock": [0, 1, 2, 5, 10, 20],
    "in_stock": [True, False],
}
EXTRA_NUMBERS = [-1, 0, 10, 10.0, 25.5, 50, 49.995, 1e9, 2.5]


# ----------------------------------------------------------------------------- the reference


def kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    return "string" if isinstance(value, str) else "number"


def reference(obj: dict, row: dict) -> bool:
    """The filter language of puma.index.filters, on one row of Python values."""
    results = []
    for key, value in obj.items():
        if key == "and":
            results.append(all(reference(f, row) for f in value))
        elif key == "or":
            results.append(any(reference(f, row) for f in value))
        elif key == "not":
            results.append(not reference(value, row))
        else:
            ops = value if isinstance(value, dict) else {"eq": value}
            results.append(all(reference_op(key, op, want, row.get(key)) for op, want in ops.items()))
    return all(results)


def reference_op(column: str, op: str, want: object, have: object) -> bool:
    if op == "exists":
        return (have is not None) == want
    first = want[0] if op == "in" else want
    if have is None or TYPES.get(column) == "json" or kind(have) != kind(first):
        return False
    return {"eq": lambda: have == want, "ne": lambda: have != want, "gt": lambda: have > want,
            "gte": lambda: have >= want, "lt": lambda: have < want, "lte": lambda: have <= want,
            "in": lambda: have in want}[op]()


# ----------------------------------------------------------------------------- a table, random filters


def random_rows(rng: np.random.Generator, n: int) -> list[dict]:
    """Rows with every column sometimes missing (None)."""
    rows = []
    for _ in range(n):
        row = {name: (None if rng.random() < 0.2 else values[rng.integers(len(values))])
               for name, values in VALUES.items()}
        row["tags"] = None if rng.random() < 0.5 else json.dumps(["a", int(rng.integers(3))])
        rows.append(row)
    return rows


def chunk(rows: list[dict]) -> pa.RecordBatch:
    """One batch: brand dictionary-encoded (its own dictionary), size large_string, tags json."""
    column = lambda name, arrow_type: pa.array([r[name] for r in rows], arrow_type)
    tags = pa.ExtensionArray.from_storage(JSON_TYPE, column("tags", pa.string()))
    return pa.RecordBatch.from_pydict({
        "category": column("category", pa.string()),
        "brand": column("brand", pa.string()).dictionary_encode(),
        "size": column("size", pa.large_string()), "price": column("price", pa.float64()),
        "stock": column("stock", pa.int64()), "in_stock": column("in_stock", pa.bool_()), "tags": tags})


@pytest.fixture(scope="module")
def table() -> pa.Table:
    rows = random_rows(np.random.default_rng(7), 400)
    return pa.Table.from_batches([chunk(rows[:150]), chunk(rows[150:])])  # two chunks, two dictionaries


def random_value(rng: np.random.Generator, column: str, op: str) -> object:
    if op == "exists":
        return bool(rng.integers(2))
    pool = VALUES.get(column, VALUES["category"])
    if op in ("gt", "gte", "lt", "lte") or rng.random() < 0.15:  # sometimes a value of another type
        pool = VALUES["price"] + VALUES["stock"] + EXTRA_NUMBERS if op not in ("eq", "ne", "in") or \
            rng.random() < 0.5 else [True, False, "boots", "nowhere"]
    if op == "in":
        one_kind = [v for v in pool if kind(v) == kind(pool[0])]
        return [one_kind[i] for i in rng.integers(len(one_kind), size=int(rng.integers(1, 4)))]
    return pool[rng.integers(len(pool))]


def random_column_filter(rng: np.random.Generator) -> dict:
    """``{col: value}`` or ``{col: {op: value, ...}}``, once in a while two columns in one object."""
    out = {}
    for _ in range(1 if rng.random() < 0.8 else 2):
        column = str(rng.choice([*TYPES, "colour"]))  # colour: a column the table lacks
        if rng.random() < 0.25:
            out[column] = random_value(rng, column, "eq")
        else:
            ops = rng.choice(OPS, size=int(rng.integers(1, 3)), replace=False)
            out[column] = {str(op): random_value(rng, column, str(op)) for op in ops}
    return out


def random_filter(rng: np.random.Generator, depth: int = 0) -> dict:
    if depth >= 2 or rng.random() < 0.4:
        return random_column_filter(rng)
    op = str(rng.choice(["and", "or", "not"]))
    if op == "not":
        return {"not": random_filter(rng, depth + 1)}
    return {op: [random_filter(rng, depth + 1) for _ in range(int(rng.integers(1, 4)))]}


def test_evaluate_equals_the_reference_on_random_filters(table):
    rng = np.random.default_rng(2025)
    rows = table.to_pylist()
    selective = 0
    for _ in range(400):
        obj = random_filter(rng)
        f = parse_filter(obj)
        got = evaluate(f, table)
        want = np.array([reference(obj, row) for row in rows])
        assert got.dtype == bool and got.shape == (table.num_rows,)
        np.testing.assert_array_equal(got, want, err_msg=json.dumps(obj))
        canonical = parse_filter(f.to_json())
        assert canonical == f and hash(canonical) == hash(f)
        np.testing.assert_array_equal(evaluate(canonical, table), want, err_msg=f.key)
        selective += 0 < want.sum() < len(want)
    assert selective > 150  # the filters tell rows apart, so a wrong evaluate shows


def test_every_operator_on_every_type(table):
    rows = table.to_pylist()
    for column, values in VALUES.items():
        for op in OPS:
            if op in ("gt", "gte", "lt", "lte") and TYPES[column] != "number":
                continue
            value = [values[0], values[-1]] if op == "in" else True if op == "exists" else values[1]
            obj = {column: {op: value}}
            check_filter(parse_filter(obj), TYPES)
            want = np.array([reference(obj, row) for row in rows])
            np.testing.assert_array_equal(evaluate(parse_filter(obj), table), want, err_msg=json.dumps(obj))
            assert 0 < want.sum() < len(want), obj


def test_the_documented_example_and_missing_values():
    table = metadata_columns(pa.array([
        '{"category": "boots", "price": 30, "in_stock": true}', '{"category": "boots", "price": 80}',
        '{"category": "boots", "in_stock": true}', None,
        '{"category": "hat", "price": 10, "in_stock": true}']))
    example = {"and": [{"category": "boots"}, {"price": {"lt": 50}}, {"in_stock": True}]}
    assert evaluate(parse_filter(example), table).tolist() == [True, False, False, False, False]
    not_cheap = parse_filter({"not": {"price": {"lt": 50}}})  # matches rows without a price
    assert evaluate(not_cheap, table).tolist() == [False, True, True, True, False]
    rows = lambda obj: evaluate(parse_filter(obj), table).tolist()
    assert rows({"price": {"ne": 30}}) == [False, True, False, False, True]
    assert rows({"price": {"exists": False}}) == [False, False, True, True, False]


def test_a_column_this_table_lacks_is_missing_everywhere(table):
    assert not evaluate(parse_filter({"colour": "red"}), table).any()
    assert not evaluate(parse_filter({"colour": {"ne": "red"}}), table).any()
    assert evaluate(parse_filter({"colour": {"exists": False}}), table).all()
    assert evaluate(parse_filter({"not": {"colour": "red"}}), table).all()
    empty = table.slice(0, 0)
    assert evaluate(parse_filter({"category": "boots"}), empty).shape == (0,)


def test_a_value_of_another_type_than_the_shards_column_matches_nothing(table):
    for obj in ({"price": "cheap"}, {"category": 5}, {"in_stock": 1}, {"stock": True}, {"tags": "a"},
                {"brand": {"in": [1, 2]}}, {"size": {"lt": 3}}):
        assert not evaluate(parse_filter(obj), table).any(), obj


def test_dictionary_columns_compare_once_per_distinct_value():
    codes = pa.array([0, 1, None, 2, 1, 0], pa.int32())
    brand = pa.DictionaryArray.from_arrays(codes, pa.array(["acme", None, "zeta"]))  # a null entry too
    table = pa.table({"brand": brand})
    rows = lambda obj: evaluate(parse_filter(obj), table).tolist()
    assert rows({"brand": "acme"}) == [True, False, False, False, False, True]
    assert rows({"brand": {"ne": "acme"}}) == [False, False, False, True, False, False]
    assert rows({"brand": {"in": ["zeta", "nord"]}}) == [False, False, False, True, False, False]
    assert rows({"brand": {"exists": True}}) == [True, False, False, True, False, True]
    assert rows({"brand": {"exists": False}}) == [False, True, True, False, True, False]


def test_numbers_compare_across_int_and_float():
    table = pa.table({"n": pa.array([1, 2, 3, None]), "x": pa.array([1.0, 2.5, 3.0, None])})
    assert evaluate(parse_filter({"n": 2.0}), table).tolist() == [False, True, False, False]
    assert evaluate(parse_filter({"n": 2.5}), table).tolist() == [False] * 4
    assert evaluate(parse_filter({"n": {"in": [1, 2.5, 3.0]}}), table).tolist() == [True, False, True, False]
    assert evaluate(parse_filter({"x": {"in": [1, 2.5]}}), table).tolist() == [True, True, False, False]
    assert evaluate(parse_filter({"n": {"gt": 1.5, "lte": 3}}), table).tolist() == [False, True, True, False]
    view = pa.table({"s": pa.array(["a", "b", None], pa.string_view())})
    assert evaluate(parse_filter({"s": {"in": ["b"]}}), view).tolist() == [False, True, False]


# ----------------------------------------------------------------------------- the tree


def test_equivalent_spellings_share_one_key():
    a = parse_filter({"price": {"gte": 10, "lt": 50}, "category": "boots"})
    b = parse_filter({"and": [{"category": {"eq": "boots"}},
                              {"and": [{"price": {"lt": 50.0}}, {"price": {"gte": 10}}]}]})
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert json.loads(a.key) == a.to_json()
    assert {a: 1}[b] == 1
    assert parse_filter({"not": {"not": {"x": 1}}}) == parse_filter({"x": 1})
    assert parse_filter({"x": {"in": [3, 1, 3]}}) == parse_filter({"x": {"in": [1, 3]}})
    assert parse_filter('{"x": 1}') == parse_filter({"x": 1})
    assert parse_filter({"x": True}) != parse_filter({"x": 1})  # true is not the number 1
    assert parse_filter({"x": 1}) != parse_filter({"x": {"ne": 1}})
    assert a.columns() == frozenset({"category", "price"})


def test_filters_are_immutable():
    f = parse_filter({"x": 1})
    with pytest.raises(AttributeError):
        f.value = 2


# ----------------------------------------------------------------------------- errors


def raises(obj: object, *parts: str, types: dict | None = None) -> str:
    """The FilterError message, checked to contain every part."""
    with pytest.raises(FilterError) as caught:
        f = parse_filter(obj)
        if types is not None:
            check_filter(f, types)
    message = str(caught.value)
    for part in parts:
        assert part in message, (part, message)
    return message


def test_an_unknown_column_lists_the_known_ones():
    raises({"and": [{"category": "boots"}, {"colour": "red"}]}, "and[1].colour", "'colour'",
           "brand, category, in_stock, price, size, stock, tags", types=TYPES)
    many = {f"c{i:02d}": "string" for i in range(40)}
    message = raises({"or": [{"c01": "a"}, {"not": {"zz": 1}}]}, "or[1].not.zz", "c00, c01", "c29, ...",
                     "(40 in all)", types=many)
    assert "c30" not in message
    raises({"x": 1}, "'x'", "none", types={})


def test_a_type_mismatch_names_the_type_and_what_it_takes():
    raises({"price": "cheap"}, "filter at price", "number column", "gt, gte, lt, lte", '"cheap" (a string)',
           types=TYPES)
    raises({"price": True}, "price", "number column", "(a boolean)", types=TYPES)  # bool is no number
    raises({"category": 5}, "category", "string column", "eq, ne and in with strings", "(a number)",
           types=TYPES)
    raises({"category": {"gt": 5}}, "category", "string column", "eq, ne and in", "got gt 5", types=TYPES)
    raises({"in_stock": {"in": [1, 0]}}, "in_stock", "boolean column", "true/false", types=TYPES)
    raises({"tags": "a"}, "tags", "json column", "only exists", types=TYPES)
    check_filter(parse_filter({"tags": {"exists": True}, "price": 5, "stock": 2.5}), TYPES)
    with pytest.raises(ValueError, match="column_types"):
        check_filter(parse_filter({"x": 1}), {"x": "date"})


def test_malformed_filters_name_the_path_and_the_valid_forms():
    raises({"price": {"less": 5}}, "price.less", "'less'", "eq, ne, gt, gte, lt, lte, in, exists")
    raises({"and": [{"x": 1}, {"category": {"in": []}}]}, "and[1].category.in", "non-empty list")
    raises({"category": {"in": "boots"}}, "category.in", "non-empty list")
    raises({"category": {"in": ["a", 1]}}, "category.in", "one kind", "number and string")
    raises({"price": {"lt": True}}, "price.lt", "takes a number", "(a boolean)")
    raises({"price": {"gte": "10"}}, "price.gte", "takes a number")
    raises({"x": {"exists": "yes"}}, "x.exists", "true or false")
    raises({"x": None}, "filter at x", '"exists": false')
    raises({"x": [1, 2]}, "filter at x", '{"in": [1, 2]}')
    raises({"x": {}}, "filter at x", "no operator", "eq, ne")
    raises({"x": {"eq": {"a": 1}}}, "x.eq", "string, number or true/false")
    raises({"x": float("nan")}, "x", "finite")
    raises({"and": []}, "filter at and", "non-empty list of filters")
    raises({"or": {"x": 1}}, "filter at or", "non-empty list of filters")
    raises({"not": [{"x": 1}]}, "filter at not", "non-empty JSON object")
    raises({}, "filter:", "non-empty JSON object", '{"and": [')
    raises(["x"], "filter:", "non-empty JSON object")
    raises({"and": [{"x": 1}, 5]}, "and[1]", "got 5")
    raises({1: 2}, "not a column name")
    raises({"unit price": {"lt": "x"}}, '["unit price"].lt')
    raises("{not json", "not valid JSON")


def test_hostile_filters_hit_the_depth_and_size_limits():
    deep = {"x": 1}
    for _ in range(MAX_DEPTH - 1):
        deep = {"not": deep}
    parse_filter(deep)  # exactly MAX_DEPTH objects deep
    raises({"not": deep}, f"at most {MAX_DEPTH} deep", "not.not.not")
    parse_filter({"or": [{"x": i} for i in range(MAX_NODES - 1)]})
    raises({"or": [{"x": i} for i in range(MAX_NODES)]}, f"at most {MAX_NODES} conditions", "or[63]")
    raises({"or": [{"x": i} for i in range(10**6)]}, f"at most {MAX_NODES}")
    raises("[" * 100_000 + "]" * 100_000, "filter")


# ----------------------------------------------------------------------------- metadata columns


def metadata(*rows: object) -> pa.Table:
    texts = [r if r is None or isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    return metadata_columns(pa.array(texts, pa.string()))


def test_numbers_booleans_strings_and_missing_keys_are_typed():
    table = metadata({"n": 1, "f": 2.5, "b": True, "s": "x"}, {"n": 2, "f": 3, "b": False}, None, "",
                     "   ", {"n": -7, "f": 1e20, "s": "y"}, {})
    assert table.num_rows == 7
    assert table.schema == pa.schema([("n", pa.int64()), ("f", pa.float64()), ("b", pa.bool_()),
                                      ("s", pa.string())])
    assert table.column("n").to_pylist() == [1, 2, None, None, None, -7, None]
    assert table.column("f").to_pylist() == [2.5, 3.0, None, None, None, 1e20, None]
    assert table.column("b").to_pylist() == [True, False, None, None, None, None, None]
    assert column_types(table) == {"n": "number", "f": "number", "b": "boolean", "s": "string"}


def test_csv_like_numbers_mix_ints_and_floats_into_float64():
    rows = [json.dumps({"price": v}) for v in [3, 4.25, 10, 0.5, 7]]
    table = metadata_columns(pa.array(rows))
    assert table.schema.field("price").type == pa.float64()
    assert table.column("price").to_pylist() == [3.0, 4.25, 10.0, 0.5, 7.0]
    assert metadata({"big": 2**70}).column("big").to_pylist() == [float(2**70)]


def test_nested_values_become_json_text():
    table = metadata({"tags": ["a", "b"], "dims": {"w": 2, "h": 1}}, {"tags": []}, {"dims": None}, None)
    assert table.schema.field("tags").type == JSON_TYPE and table.schema.field("dims").type == JSON_TYPE
    assert table.column("tags").to_pylist() == ['["a","b"]', "[]", None, None]
    assert table.column("dims").to_pylist() == ['{"h":1,"w":2}', None, None, None]
    assert column_types(table) == {"tags": "json", "dims": "json"}
    assert evaluate(parse_filter({"tags": {"exists": True}}), table).tolist() == [True, True, False, False]


def test_mixed_kinds_become_strings_of_json_text():
    rows = [{"size": 42, "n": 1}, {"size": "XL", "n": 2}, {"size": True}, {"size": 2.5}, {}, {"size": [1]},
            {"size": "7"}]
    table = metadata(*rows[:5], rows[6])  # numbers, strings and booleans: a string column
    assert table.schema.field("size").type == pa.string()
    assert table.column("size").to_pylist() == ["42", "XL", "true", "2.5", None, "7"]
    assert table.column("n").to_pylist() == [1, 2, None, None, None, None]
    assert table.schema.field("n").type == pa.int64()
    reversed_table = metadata(*reversed(rows[:5]))  # the same typing whatever the order
    assert reversed_table.column("size").to_pylist() == [None, "2.5", "true", "XL", "42"]
    with_a_list = metadata(*rows)  # any list or object: a json column
    assert with_a_list.schema.field("size").type == JSON_TYPE
    assert with_a_list.column("size").to_pylist() == ["42", '"XL"', "true", "2.5", None, "[1]", '"7"']


def test_the_python_fallback_types_plain_columns_as_arrow_does():
    rng = np.random.default_rng(3)
    rows = [{"i": int(rng.integers(-5, 5)), "f": float(rng.random()), "b": bool(rng.integers(2)),
             "s": f"v{rng.integers(9)}", "mixed": [1, 2.5][i % 2], "d": "2024-05-01"} for i in range(50)]
    for i in range(0, 50, 7):
        del rows[i]["s"]
    fast = metadata(*rows)
    for odd in ({"nested": {"a": 1}}, {"x": 1}, {"x": "y"}):  # nested; then Arrow fails on x: mixed kinds
        slow = metadata(*rows, {}, odd, *([{"x": 2}] if "x" in odd else [])).slice(0, len(rows))
        assert slow.select(fast.column_names).equals(fast), odd
    assert fast.schema.field("d").type == pa.string()  # an ISO date stays a string


def test_unicode_newlines_and_order_survive():
    pretty = '{\n  "名前": "帽子",\n  "emoji": "é\\nà"\n}'  # indented JSON over four lines
    table = metadata({"名前": "靴", "emoji": "🥾"}, pretty, {"名前": "x\u2028y"})
    assert table.column_names == ["名前", "emoji"]
    assert table.column("名前").to_pylist() == ["靴", "帽子", "x\u2028y"]
    assert table.column("emoji").to_pylist() == ["🥾", "é\nà", None]
    assert describe_columns(table)["名前"] == {"type": "string", "values": ["x\u2028y", "帽子", "靴"]}


def test_null_only_keys_give_no_column_and_rows_keep_their_count():
    table = metadata({"a": None}, None, {"a": None})
    assert table.num_rows == 3 and table.column_names == []
    assert metadata_columns(pa.array([], pa.string())).num_rows == 0
    chunked = pa.chunked_array([pa.array(['{"a": 1}', None]), pa.array(['{"a": 3}'])])
    assert metadata_columns(chunked).column("a").to_pylist() == [1, None, 3]
    encoded = pa.array(['{"a": "x"}', '{"a": "x"}', None]).dictionary_encode()
    assert metadata_columns(encoded).column("a").to_pylist() == ["x", "x", None]


def test_rows_that_are_not_objects_are_named():
    with pytest.raises(MetadataError, match=r"row 1 is not valid JSON.*\{\"color\": \"red\"\}"):
        metadata({"a": 1}, '{"a": ')
    with pytest.raises(MetadataError, match="row 2 is a JSON list, not an object"):
        metadata({"a": 1}, {"a": 2}, "[1, 2]")
    with pytest.raises(MetadataError, match="row 0 is not valid JSON"):
        metadata('{"a": 1} {"a": 2}', {"a": 3})  # two objects in one row would shift every later row


def test_a_hundred_thousand_rows():
    rng = np.random.default_rng(0)
    n = 100_000
    prices, stock = rng.integers(1, 500, n) / 4, rng.integers(0, 50, n)
    rows = [json.dumps({"category": f"c{i % 37}", "price": float(p) if i % 3 else int(p), "stock": int(s),
                        "in_stock": bool(s)} if i % 11 else {})
            for i, (p, s) in enumerate(zip(prices, stock, strict=True))]
    strings = pa.array(rows)
    start = time.perf_counter()
    table = metadata_columns(strings)
    seconds = time.perf_counter() - start
    print(f"metadata_columns: {n} rows in {seconds:.3f} s")
    assert table.num_rows == n
    assert column_types(table) == {"category": "string", "price": "number", "stock": "number",
                                   "in_stock": "boolean"}
    empty = np.arange(n) % 11 == 0
    want_price = np.where(empty, np.nan, np.where(np.arange(n) % 3, prices, np.floor(prices)))
    np.testing.assert_array_equal(table.column("price").to_numpy(), want_price)
    start = time.perf_counter()
    f = parse_filter({"category": {"in": ["c1", "c2"]}, "price": {"lt": 50}, "in_stock": True})
    got = evaluate(f, table)
    print(f"evaluate: {n} rows in {time.perf_counter() - start:.3f} s")
    category = np.arange(n) % 37
    want = ~empty & np.isin(category, [1, 2]) & (want_price < 50) & (stock > 0)
    np.testing.assert_array_equal(got, want)


def test_describe_columns_lists_few_distinct_strings(table):
    described = describe_columns(table, max_values=4)
    assert described["brand"] == {"type": "string", "values": ["acme", "nord", "zeta", "ösel"]}
    assert described["size"] == {"type": "string", "values": ["L", "M", "S"]}
    assert described["category"] == {"type": "string"}  # five distinct values > max_values
    assert described["price"] == {"type": "number"} and described["tags"] == {"type": "json"}
    assert described["in_stock"] == {"type": "boolean"}
    assert column_types(table) == TYPES


@pytest.mark.parametrize("arrow_type", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(),
                                        pa.float64()])
def test_numeric_comparisons_in_numpy_equal_arrows_kernels(arrow_type):
    """The numpy path of a number comparison (filter_eval._numeric_rows) gives Arrow's answer, nulls as
    no match, on every signed-integer and float type, on a slice (an offset into the buffers), with NaN."""
    from puma.index.filter_eval import _compared, _numeric_rows, _true_rows
    from puma.index.filter_tree import Condition

    rng = np.random.default_rng(5)
    floating = pa.types.is_floating(arrow_type)
    numbers = rng.integers(-100, 100, 3000).astype(arrow_type.to_pandas_dtype())
    if floating:
        numbers[::97] = np.nan
    values = pa.array(numbers, arrow_type, mask=rng.random(3000) < 0.1).slice(37, 2900)
    for op in ("eq", "ne", "gt", "gte", "lt", "lte"):
        for value in (0, 7, -100, 99, 2.5, -0.5, 1e20, -1e20, 2 ** 62, float("inf")):
            condition = Condition("n", op, value)
            fast = _numeric_rows(condition, values)
            assert fast is not None, (op, value)
            try:
                arrow = _true_rows(_compared(condition, values))
            except pa.ArrowInvalid:  # Arrow refuses an int a float32 cannot hold exactly: compare in float64
                as_float = values.cast(pa.float64())
                arrow = _true_rows(_compared(Condition("n", op, float(value)), as_float))
            np.testing.assert_array_equal(fast, arrow, err_msg=f"{arrow_type} {op} {value}")
    assert _numeric_rows(Condition("n", "eq", 2 ** 64), values) is None  # beyond int64: Arrow decides
    assert _numeric_rows(Condition("n", "in", (1, 2)), values) is None
