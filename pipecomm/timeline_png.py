"""A PNG of one step's timeline, drawn from ``Pipeline.trace``'s Chrome trace: a lane per rank, a colour per action."""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Sequence

__all__ = ["COLOURS", "encode_png", "render_timeline", "write_timeline_png"]

Colour = tuple[int, int, int]

# Transfers by direction only, whichever pass they carry.
COLOURS: dict[str, Colour] = {
    "F": (76, 114, 176),
    "B": (85, 168, 104),
    "I": (221, 132, 82),
    "W": (129, 114, 179),
    "SEND": (110, 110, 110),
    "RECV": (180, 180, 180),
    "idle": (248, 212, 212),
}
LEGEND = (("F", "F forward"), ("B", "B backward"), ("I", "I input grad"), ("W", "W weight grad"), ("SEND", "send"),
          ("RECV", "receive"), ("idle", "idle: the bubble"))
BACKGROUND: Colour = (255, 255, 255)
INK: Colour = (30, 30, 30)

# 5x7 glyphs: a character, then its seven rows top first, each row's five pixels the low bits of a hex byte.
_GLYPH_ROWS = """
A 0e11111f111111 B 1e11111e11111e C 0e11101010110e D 1e11111111111e E 1f10101e10101f F 1f10101e101010
G 0e11101711110f H 1111111f111111 I 0e04040404040e J 0702020202120c K 11121418141211 L 1010101010101f
M 111b1515111111 N 11111915131111 O 0e11111111110e P 1e11111e101010 Q 0e11111115120d R 1e11111e141211
S 0f10100e01011e T 1f040404040404 U 1111111111110e V 11111111110a04 W 1111111515150a X 11110a040a1111
Y 1111110a040404 Z 1f01020408101f 0 0e11131519110e 1 040c040404040e 2 0e11010204081f 3 1f02040201110e
4 02060a121f0202 5 1f101e0101110e 6 0608101e11110e 7 1f010204080808 8 0e11110e11110e 9 0e11110f01020c
. 00000000000c0c , 000000000c0408 : 000c0c000c0c00 ; 000c0c000c0408 - 0000001f000000 % 18190204081303 ( 02040808080402
) 08040202020408 / 00010204081000 = 00001f001f0000 + 0004041f040400 _ 0000000000001f
"""
_TOKENS = _GLYPH_ROWS.split()
GLYPHS: dict[str, tuple[int, ...]] = {char: tuple(bytes.fromhex(rows))
                                      for char, rows in zip(_TOKENS[::2], _TOKENS[1::2])}
GLYPH_WIDTH, GLYPH_HEIGHT = 5, 7

_ACTION = re.compile(r"([A-Z]+)(?:_[FB])?(\d+)\.(\d+)")  # str(Action): kind, stage, micro-batch ("SEND_F1.3")


class Canvas:
    """RGB pixels, filled by rectangles and text."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(BACKGROUND) * (width * height))

    def fill(self, left: int, top: int, right: int, bottom: int, colour: Colour) -> None:
        """Pixels [left, right) x [top, bottom), clipped to the canvas."""
        left, right = max(0, left), min(self.width, right)
        top, bottom = max(0, top), min(self.height, bottom)
        if left >= right:
            return
        row = bytes(colour) * (right - left)
        for y in range(top, bottom):
            start = (y * self.width + left) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, left: int, top: int, text: str, colour: Colour = INK, scale: int = 1) -> None:
        """In capitals; a character without a glyph is drawn as a space."""
        for index, char in enumerate(text.upper()):
            x = left + index * (GLYPH_WIDTH + 1) * scale
            for row, bits in enumerate(GLYPHS.get(char, ())):
                for column in range(GLYPH_WIDTH):
                    if bits >> (GLYPH_WIDTH - 1 - column) & 1:
                        self.fill(x + column * scale, top + row * scale, x + (column + 1) * scale,
                                  top + (row + 1) * scale, colour)


def text_width(text: str, scale: int = 1) -> int:
    return max(0, len(text) * (GLYPH_WIDTH + 1) - 1) * scale


def encode_png(width: int, height: int, pixels: bytes) -> bytes:
    """8-bit RGB, every row unfiltered, one zlib stream."""
    stride = width * 3
    raw = b"".join(b"\x00" + pixels[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


# Layout, in pixels.
MARGIN, LABEL_WIDTH, TITLE_SCALE = 16, 130, 2
COMPUTE_HEIGHT, COMM_HEIGHT, LANE_GAP = 40, 12, 22
AXIS_HEIGHT, LEGEND_HEIGHT = 36, 30


def render_timeline(trace: dict, title: str = "", notes: Sequence[str] = (), width: int = 1200) -> Canvas:
    """Every rank's lane over the step's span: compute actions (micro-batch index inside) on the idle colour, which
    shows the bubble, and transfers on a thin lane beneath when the trace has them; ``notes[rank]`` under each rank's
    label; a time axis and a legend."""
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X"]
    ranks = sorted({event["pid"] for event in events})
    has_comm = any(event["tid"] == "comm" for event in events)
    start = min((event["ts"] for event in events), default=0.0)
    span = max((event["ts"] + event["dur"] for event in events), default=1.0) - start or 1.0
    lane_height = COMPUTE_HEIGHT + (COMM_HEIGHT + 2 if has_comm else 0)
    lanes_top = MARGIN + GLYPH_HEIGHT * TITLE_SCALE + MARGIN
    height = lanes_top + len(ranks) * (lane_height + LANE_GAP) + AXIS_HEIGHT + LEGEND_HEIGHT + MARGIN
    canvas = Canvas(width, height)
    plot_left, plot_right = MARGIN + LABEL_WIDTH, width - MARGIN

    def x_of(microseconds: float) -> int:
        return plot_left + round((microseconds - start) / span * (plot_right - plot_left))

    canvas.text(MARGIN, MARGIN, title, scale=TITLE_SCALE)
    for lane, rank in enumerate(ranks):
        top = lanes_top + lane * (lane_height + LANE_GAP)
        canvas.text(MARGIN, top + 8, f"rank {rank}", scale=2)
        if lane < len(notes):
            canvas.text(MARGIN, top + 8 + 2 * GLYPH_HEIGHT + 6, notes[lane])
        mine = [event for event in events if event["pid"] == rank]
        # Idle from the rank's first action to its last: before and after, the step has not reached it or has left.
        canvas.fill(x_of(min(event["ts"] for event in mine)), top,
                    x_of(max(event["ts"] + event["dur"] for event in mine)), top + COMPUTE_HEIGHT, COLOURS["idle"])
        for event in mine:
            match = _ACTION.fullmatch(event["name"])
            kind, micro_batch = (match.group(1), match.group(3)) if match else (event["name"], "")
            left, right = x_of(event["ts"]), x_of(event["ts"] + event["dur"])
            right = max(right, left + 1)  # every action shows, however short
            if event["tid"] == "comm":
                comm_top = top + COMPUTE_HEIGHT + 2
                canvas.fill(left, comm_top, right, comm_top + COMM_HEIGHT, COLOURS.get(kind, INK))
                continue
            canvas.fill(left, top, right, top + COMPUTE_HEIGHT, COLOURS.get(kind, INK))
            if right - left >= 3:  # a white edge between back-to-back actions
                canvas.fill(right - 1, top, right, top + COMPUTE_HEIGHT, BACKGROUND)
            if text_width(micro_batch) + 4 <= right - left:
                canvas.text((left + right - text_width(micro_batch)) // 2, top + (COMPUTE_HEIGHT - GLYPH_HEIGHT) // 2,
                            micro_batch, BACKGROUND)
    _axis(canvas, lanes_top + len(ranks) * (lane_height + LANE_GAP), plot_left, plot_right, span)
    _legend(canvas, height - MARGIN - LEGEND_HEIGHT + 8)
    return canvas


def _axis(canvas: Canvas, top: int, plot_left: int, plot_right: int, span_us: float) -> None:
    """A line with a tick and label every 1, 2 or 5 x 10^k ms, at most ten of them."""
    canvas.fill(plot_left, top, plot_right, top + 1, INK)
    span_ms = span_us / 1e3
    step = next(base * 10.0**power for power in range(-3, 7) for base in (1, 2, 5)
                if span_ms / (base * 10.0**power) <= 10)
    for index in range(int(span_ms / step + 1e-9) + 1):
        x = plot_left + round(index * step / span_ms * (plot_right - plot_left))
        canvas.fill(x, top, x + 1, top + 5, INK)
        label = f"{index * step:.4g}"
        canvas.text(x - text_width(label) // 2, top + 8, label)
    canvas.text(plot_left - text_width("ms") - 10, top + 8, "ms")


def _legend(canvas: Canvas, top: int) -> None:
    x = MARGIN
    for key, label in LEGEND:
        canvas.fill(x, top, x + 14, top + 14, COLOURS[key])
        canvas.text(x + 20, top + 4, label)
        x += 20 + text_width(label) + 24


def write_timeline_png(trace_path: str, png_path: str, title: str = "", notes: Sequence[str] = ()) -> None:
    """Reads the Chrome trace ``Pipeline.trace`` wrote and writes its picture (see ``render_timeline``)."""
    with open(trace_path) as file:
        canvas = render_timeline(json.load(file), title, notes)
    with open(png_path, "wb") as file:
        file.write(encode_png(canvas.width, canvas.height, bytes(canvas.pixels)))
