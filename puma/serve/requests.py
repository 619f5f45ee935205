"""What a search request may hold, parsed from an HTTP body, with a one-line 4xx for anything else.

No Ray and no web framework here: the ingress hands over the Content-Type, the body (already cut at
serve.max_upload_bytes) and the query parameters, and gets a ``SearchRequest`` or a RequestError.

    query      how it is sent
    image      the raw body (Content-Type image/* or application/octet-stream), the file field
               ``image`` of a multipart form, or JSON ``{"image_base64": "..."}``
    item_id    JSON ``{"item_id": "..."}``: the item's stored embedding; the item itself is left out
               of its hits unless ``include_self``
    vector     JSON ``{"vector": [E floats]}``: an embedding of the index's model

Options, as JSON fields, query parameters or form fields: ``k`` (1..serve.max_k, default
serve.default_k), ``dataset`` and ``catalogue`` (a name or a list of names: hits only from those;
a catalogue is named by its URI or its folder name), ``include_self``.

Statuses: 400 malformed (bad JSON, wrong type, unknown or missing field), 413 too large (bytes or
pixels), 415 not an image or an unsupported Content-Type, 422 a value out of range.
"""

from __future__ import annotations

import base64
import binascii
import email.parser
import email.policy
import io
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from puma.config import ServeConfig
from puma.data.images import ImageRejected, ViewSpec, make_view
from puma.index.filters import Filter, FilterError, parse_filter
from puma.serve.errors import RequestError

Params = Mapping[str, Sequence[str]]  # query parameters or form fields: name -> every value given
QUERY_FIELDS = ("item_id", "vector", "image_base64")
OPTION_FIELDS = ("k", "dataset", "catalogue", "include_self", "filter")
JSON_FIELDS = QUERY_FIELDS + OPTION_FIELDS
IMAGE_FIELD = "image"  # the file field of a multipart form
JSON_EXAMPLE = '{"item_id": "cub/0001.jpg", "k": 8} or {"vector": [0.1, ...], "k": 8}'


@dataclass(frozen=True)
class Limits:
    """What a request may ask for (from ServeConfig)."""

    default_k: int = 10
    max_k: int = 100
    max_upload_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    retry_after_s: float = 1.0  # the Retry-After of the service's own 503s

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> Limits:
        return cls(cfg.default_k, cfg.max_k, cfg.max_upload_bytes, cfg.max_image_pixels, cfg.retry_after_s)


@dataclass
class SearchRequest:
    """One parsed query: exactly one of image, item_id, vector, plus its options."""

    kind: str  # image | item_id | vector
    k: int
    image: bytes = b""
    item_id: str = ""
    vector: np.ndarray | None = None  # (E,) float32
    datasets: tuple[str, ...] = ()
    catalogues: tuple[str, ...] = ()
    include_self: bool = False
    where: Filter | None = None  # the "filter" option (puma.index.filters)

    def describe(self) -> dict:
        """The query as the response echoes it (no image bytes, no vector values)."""
        what = {"image": {"bytes": len(self.image)}, "item_id": {"item_id": self.item_id},
                "vector": {"dim": 0 if self.vector is None else int(self.vector.shape[0])}}[self.kind]
        where = None if self.where is None else self.where.to_json()
        return {"kind": self.kind, **what, "k": self.k, "dataset": list(self.datasets),
                "catalogue": list(self.catalogues), "filter": where}


def media_type(content_type: str) -> str:
    """``image/jpeg; charset=x`` -> ``image/jpeg`` (lower case)."""
    return content_type.split(";", 1)[0].strip().lower()


def parse_request(content_type: str, body: bytes, params: Params, limits: Limits) -> SearchRequest:
    """A request from its Content-Type, body and query parameters; RequestError when it is not one."""
    kind = media_type(content_type)
    if kind == "application/json":
        return parse_json(body, params, limits)
    if kind == "multipart/form-data":
        return parse_multipart(content_type, body, params, limits)
    if kind.startswith("image/") or kind in ("application/octet-stream", ""):
        return image_request(body, params, limits)
    raise RequestError(415, f"unsupported Content-Type {kind!r}: send application/json ({JSON_EXAMPLE}), "
                            "an image (image/*), or a multipart form with an 'image' file")


def parse_json(body: bytes, params: Params, limits: Limits) -> SearchRequest:
    """A JSON query (item_id, vector or image_base64) with its options; params fill in what it lacks."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"malformed JSON: {exc}; expected e.g. {JSON_EXAMPLE}") from exc
    if not isinstance(data, dict):
        raise RequestError(400, f"the JSON body must be an object, got {type(data).__name__}; "
                                f"e.g. {JSON_EXAMPLE}")
    unknown = sorted(set(data) - set(JSON_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; valid: {list(JSON_FIELDS)}")
    given = [f for f in QUERY_FIELDS if f in data]
    if len(given) != 1:
        raise RequestError(400, f"give exactly one of {list(QUERY_FIELDS)} (got {given or 'none'}); "
                                f"e.g. {JSON_EXAMPLE}")
    options = {**{name: list(values) for name, values in params.items()}, **data}
    request = SearchRequest(kind=given[0], **parse_options(options, limits))
    if request.kind == "item_id":
        request.item_id = _item_id(data["item_id"])
    elif request.kind == "vector":
        request.vector = parse_vector(data["vector"])
    else:
        request.kind, request.image = "image", _base64_image(data["image_base64"], limits)
    return request


def image_request(body: bytes, params: Params, limits: Limits) -> SearchRequest:
    """A raw image body with its options from the query parameters."""
    _check_image_size(body, limits)
    return SearchRequest(kind="image", image=body, **parse_options(params, limits))


def parse_multipart(content_type: str, body: bytes, params: Params, limits: Limits) -> SearchRequest:
    """A multipart form: the file field ``image`` plus option fields (query parameters fill in)."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise RequestError(400, "malformed multipart form: no parts found (is the boundary right?)")
    fields: dict[str, list] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise RequestError(400, "malformed multipart form: a part has no name")
        fields.setdefault(str(name), []).append(part.get_payload(decode=True) or b"")
    unknown = sorted(set(fields) - {IMAGE_FIELD, *OPTION_FIELDS})
    if unknown:
        raise RequestError(400, f"unknown form field(s) {unknown}; valid: {[IMAGE_FIELD, *OPTION_FIELDS]}")
    if len(fields.get(IMAGE_FIELD, [])) != 1:
        raise RequestError(400, f"the form needs exactly one file field {IMAGE_FIELD!r}")
    text = {name: [v.decode("utf-8", "replace") for v in values]
            for name, values in fields.items() if name != IMAGE_FIELD}
    return image_request(fields[IMAGE_FIELD][0], {**params, **text}, limits)


def parse_options(options: Mapping, limits: Limits) -> dict:
    """k, dataset, catalogue and include_self from JSON values or parameter value lists."""
    return {"k": parse_k(_one(options, "k", limits.default_k), limits.max_k),
            "datasets": _names(options.get("dataset"), "dataset"),
            "catalogues": _names(options.get("catalogue"), "catalogue"),
            "include_self": _flag(_one(options, "include_self", False)),
            "where": filter_option(options.get("filter"))}


def filter_option(value) -> Filter | None:
    """The "filter" option: a JSON object (or its text, from a query parameter or form field; or a parsed
    Filter); 422 naming what is wrong when it is not a filter."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = value[-1]  # query parameters and form fields: the last one
    if value is None or value == "":
        return None
    try:
        return parse_filter(value)
    except FilterError as exc:
        raise RequestError(422, f"filter: {exc}") from exc


def parse_k(value, max_k: int) -> int:
    """k as an int in [1, max_k]: 400 when it is not an integer, 422 when out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RequestError(400, f"k must be an integer, got {value!r}")
    try:
        k = int(value)
    except ValueError as exc:
        raise RequestError(400, f"k must be an integer, got {value!r}") from exc
    if not 1 <= k <= max_k:
        raise RequestError(422, f"k={k} is out of range; valid: 1 <= k <= {max_k} (serve.max_k)")
    return k


def parse_vector(value) -> np.ndarray:
    """A JSON list of numbers -> (E,) float32; 400 if not a list of numbers, 422 if empty or not finite."""
    if not isinstance(value, list) or not {type(x) for x in value} <= {int, float}:  # bool is not int here
        raise RequestError(400, "vector must be a list of numbers, e.g. [0.12, -0.03, ...]")
    with np.errstate(over="ignore"):
        vector = np.asarray(value, dtype=np.float32)  # (E,); beyond float32 becomes inf, refused below
    if vector.size == 0:
        raise RequestError(422, "vector is empty; give the index's embedding dimension of numbers")
    if not np.isfinite(vector).all():
        raise RequestError(422, "vector has NaN or infinite values (or values beyond float32)")
    return vector


def image_view(data: bytes, view: ViewSpec, max_pixels: int) -> np.ndarray:
    """Image bytes -> the model's eval view (3, S, S) float32; 413 / 415 / 422 with the reason."""
    if not data:
        raise RequestError(400, "the image is empty (0 bytes)")
    width, height = _image_size(data)
    if width * height > max_pixels:
        raise RequestError(413, f"image is {width}x{height} = {width * height} pixels; the limit is "
                                f"{max_pixels} (serve.max_image_pixels)")
    try:
        return make_view(data, view)
    except ImageRejected as exc:
        if exc.reason == "tiny":
            raise RequestError(422, f"image is too small ({exc.detail}); its shorter side must be at "
                                    f"least {view.min_size} px") from exc
        if exc.reason == "too_large":
            raise RequestError(413, f"image is too large to decode ({exc.detail})") from exc
        raise RequestError(415, f"not a usable image ({exc.reason}: {exc.detail})") from exc


def _image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image header, without decoding pixels; 415 when it is no image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as img:
                return img.size
    except Image.DecompressionBombError as exc:
        raise RequestError(413, f"image is too large: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: every failure to identify is "not an image"
        raise RequestError(415, f"not an image ({len(data)} bytes that no image decoder recognises); send "
                                "a JPEG, PNG, WebP, GIF, BMP or TIFF file") from exc


def _check_image_size(data: bytes, limits: Limits) -> None:
    if len(data) > limits.max_upload_bytes:
        raise RequestError(413, f"image is {len(data)} bytes; the limit is {limits.max_upload_bytes} "
                                "(serve.max_upload_bytes)")


def _base64_image(value, limits: Limits) -> bytes:
    if not isinstance(value, str):
        raise RequestError(400, "image_base64 must be a string of base64-encoded image bytes")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"image_base64 is not valid base64: {exc}") from exc
    _check_image_size(data, limits)
    return data


def _item_id(value) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(400, f"item_id must be a non-empty string, got {value!r}")
    return value


def _one(options: Mapping, name: str, default):
    """A single option value: JSON scalars as they are, parameter lists by their last value."""
    value = options.get(name, default)
    if isinstance(value, list):
        return value[-1] if value else default
    return value


def _names(value, name: str) -> tuple[str, ...]:
    """A name or a list of names -> a sorted tuple without blanks; 400 for anything else."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in values):
        raise RequestError(400, f"{name} must be a name or a list of names, got {value!r}")
    return tuple(sorted({v for v in values if v}))


def _flag(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no", ""):
        return value.lower() in ("true", "1", "yes")
    raise RequestError(400, f"include_self must be true or false, got {value!r}")
