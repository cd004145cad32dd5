"""Empty zarr arrays for the tests, written the same way with zarr 2 and zarr 3.

pyproject allows both (Python 3.10 installs zarr 2, whose interface lacks ``create_array``
and the ``zarr_format`` argument), so the data tests run under either.
"""

from __future__ import annotations

from typing import Any

import pytest
import zarr

ZARR_MAJOR = int(zarr.__version__.split(".")[0])


def new_array(
    store: Any,
    *,
    shape: tuple[int, ...],
    dtype: Any,
    zarr_format: int | None = None,
    chunks: tuple[int, ...] | None = None,
    write_empty_chunks: bool = False,
    **kwargs: Any,
) -> zarr.Array:
    """A new array (overwriting what ``store`` held) filled with ``fill_value`` (default 0).

    Args:
        store: a folder path or a zarr store.
        shape, dtype, chunks: the array's; ``chunks=None`` lets zarr choose.
        zarr_format: 2 or 3; ``None``: the installed zarr's default (3 with zarr 3). Under
            zarr 2, format 3 skips the calling test (zarr 2 cannot write it; the skip is
            reported).
        write_empty_chunks: store chunks that hold only the fill value (zarr's default skips
            them).
        kwargs: passed on, e.g. ``fill_value=None`` (no fill value in the metadata), or
            ``shards`` (format 3).
    """
    if chunks is not None:
        kwargs["chunks"] = chunks
    if ZARR_MAJOR < 3:
        if zarr_format not in (None, 2):
            pytest.skip(f"zarr {zarr.__version__} writes zarr format 2 only")
        kwargs["write_empty_chunks"] = write_empty_chunks
        return zarr.open_array(store, mode="w", shape=shape, dtype=dtype, **kwargs)
    return zarr.create_array(
        store,
        shape=shape,
        dtype=dtype,
        zarr_format=3 if zarr_format is None else zarr_format,
        config={"write_empty_chunks": write_empty_chunks},
        overwrite=True,
        **kwargs,
    )
