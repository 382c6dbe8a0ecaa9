"""The timeline picture: a PNG that decodes, with each rank's actions where the Chrome trace puts them."""

from __future__ import annotations

import json
import struct
import zlib

from pipecomm.timeline_png import COLOURS, write_timeline_png

# Two ranks, 60 ms: rank 0 runs F0.0 and F0.1, idles, then B0.1 to the end; rank 1 receives, then runs F1.0.
TRACE = {"traceEvents": [
    {"name": "F0.0", "ph": "X", "ts": 0.0, "dur": 10e3, "pid": 0, "tid": "compute"},
    {"name": "F0.1", "ph": "X", "ts": 10e3, "dur": 10e3, "pid": 0, "tid": "compute"},
    {"name": "SEND_F0.0", "ph": "X", "ts": 10e3, "dur": 1e3, "pid": 0, "tid": "comm"},
    {"name": "B0.1", "ph": "X", "ts": 40e3, "dur": 20e3, "pid": 0, "tid": "compute"},
    {"name": "RECV_F1.0", "ph": "X", "ts": 0.0, "dur": 11e3, "pid": 1, "tid": "comm"},
    {"name": "F1.0", "ph": "X", "ts": 11e3, "dur": 10e3, "pid": 1, "tid": "compute"},
]}


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit RGB PNG with unfiltered rows, checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        tag, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])
        assert crc == zlib.crc32(tag + body), tag
        chunks[tag] = chunks.get(tag, b"") + body
        offset += 12 + length
    assert set(chunks) == {b"IHDR", b"IDAT", b"IEND"}
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    assert all(raw[y * stride] == 0 for y in range(height))  # filter "none" on every row
    return width, height, [raw[y * stride + 1:(y + 1) * stride] for y in range(height)]


def runs(row: bytes) -> list[tuple[tuple[int, int, int], int, int]]:
    """A pixel row as (colour, first x, last x) runs."""
    pixels = [tuple(row[x:x + 3]) for x in range(0, len(row), 3)]
    found = []
    for x, colour in enumerate(pixels):
        if found and found[-1][0] == colour:
            found[-1] = (colour, found[-1][1], x)
        else:
            found.append((colour, x, x))
    return found


def test_the_png_shows_each_action_at_its_time(tmp_path):
    trace_path, png_path = tmp_path / "trace.json", tmp_path / "timeline.png"
    trace_path.write_text(json.dumps(TRACE))
    write_timeline_png(str(trace_path), str(png_path), title="1f1b, 2 ranks", notes=["bubble 33%", "bubble 0%"])
    width, height, rows = decode_png(png_path.read_bytes())
    assert width == 1200 and 200 < height < 400
    colours = {name: tuple(colour) for name, colour in COLOURS.items()}
    # A lane's top row, above the micro-batch numbers: the first row holding a forward's colour is rank 0's.
    lane_rows = [y for y, row in enumerate(rows) if any(colour == colours["F"] for colour, _, _ in runs(row))]
    rank0 = [run for run in runs(rows[lane_rows[0]]) if run[0] in (colours["F"], colours["B"], colours["idle"])]
    kinds = [next(name for name, colour in colours.items() if colour == run[0]) for run in rank0]
    assert kinds == ["F", "F", "idle", "B"], kinds
    # Time maps linearly onto x: F0.0 and the idle gap (10 and 20 ms) against B0.1 (20 ms), up to the edge pixel
    # each block gives up to the white line between back-to-back actions.
    first, idle, last = rank0[0], rank0[2], rank0[3]
    span = last[2] + 1 - first[1]
    assert abs((first[2] + 1 - first[1]) - span / 6) <= 2
    assert abs((idle[2] + 1 - idle[1]) - span / 3) <= 2
    assert abs((last[2] + 1 - last[1]) - span / 3) <= 2
    # Rank 1's lane, below: idle while it receives, then its forward.
    rank1_row = next(y for y in lane_rows if y > lane_rows[0] + 40)
    rank1 = [run[0] for run in runs(rows[rank1_row]) if run[0] in (colours["F"], colours["idle"])]
    assert rank1 == [colours["idle"], colours["F"]]
    # Transfers on their own thin lane, and a legend with a swatch of every colour.
    everywhere = {colour for row in rows for colour, _, _ in runs(row)}
    assert {colours["SEND"], colours["RECV"], colours["I"], colours["W"]} <= everywhere
