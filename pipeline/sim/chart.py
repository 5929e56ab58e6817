"""A small PNG line chart, stdlib only (zlib): stacked panels, one line per controller, labelled.

The project's libraries do not include a plotting package, and the demo's
chart needs only lines, axes and a few words, so it draws them itself with a
5×7 bitmap font (upper case, digits, a little punctuation).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

FONT = {  # 5×7 glyphs, one string of five bits per row
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000", "/": "00001 00010 00010 00100 01000 01000 10000",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    ":": "00000 01100 01100 00000 01100 01100 00000", "%": "11001 11010 00010 00100 01000 01011 10011",
    ",": "00000 00000 00000 00000 01100 00100 01000", "=": "00000 00000 11111 00000 11111 00000 00000",
}
COLOURS = [(200, 60, 50), (230, 150, 20), (30, 110, 200), (60, 160, 80), (140, 80, 170)]
WHITE, GREY, DARK = (255, 255, 255), (215, 215, 215), (60, 60, 60)


@dataclass
class Panel:
    title: str
    series: dict[str, list[tuple[float, float]]]
    y_max: float


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, colour: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(colour)

    def line(self, x0: float, y0: float, x1: float, y1: float, colour: tuple[int, int, int], thick: int = 1) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for s in range(steps + 1):
            t = s / steps
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            for dx in range(thick):
                for dy in range(thick):
                    self.dot(x + dx, y + dy, colour)

    def text(self, x: int, y: int, words: str, colour: tuple[int, int, int] = DARK, scale: int = 2) -> int:
        for ch in words.upper().replace("×", "X"):
            rows = FONT.get(ch, FONT[" "]).split()
            for r, bits in enumerate(rows):
                for c, bit in enumerate(bits):
                    if bit == "1":
                        for dx in range(scale):
                            for dy in range(scale):
                                self.dot(x + c * scale + dx, y + r * scale + dy, colour)
            x += 6 * scale
        return x

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width:3 * (y + 1) * self.width])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(
            b"IEND", b"")


def render(path: Path, title: str, panels: list[Panel], x_max: float, width: int = 1000,
           panel_height: int = 220) -> Path:
    left, right, top_pad, gap = 90, 50, 70, 60
    height = top_pad + len(panels) * (panel_height + gap) + 30
    canvas = Canvas(width, height)
    canvas.text(left, 15, title, scale=2)
    labels = list(panels[0].series)
    x = left
    for i, label in enumerate(labels):
        colour = COLOURS[i % len(COLOURS)]
        canvas.line(x, 46, x + 24, 46, colour, thick=3)
        x = canvas.text(x + 30, 40, label, scale=2) + 24
    plot_w = width - left - right
    for p, panel in enumerate(panels):
        y0 = top_pad + p * (panel_height + gap) + 20
        canvas.text(left, y0 - 18, panel.title, scale=2)
        for k in range(5):
            gy = y0 + panel_height - k * panel_height / 4
            canvas.line(left, gy, left + plot_w, gy, GREY)
            canvas.text(8, int(gy) - 6, _number(panel.y_max * k / 4), scale=2)
        canvas.line(left, y0, left, y0 + panel_height, DARK)
        canvas.line(left, y0 + panel_height, left + plot_w, y0 + panel_height, DARK)
        for i, label in enumerate(labels):
            points = panel.series.get(label, [])
            colour = COLOURS[i % len(COLOURS)]
            prev = None
            for px, py in points:
                sx = left + plot_w * min(px, x_max) / x_max
                sy = y0 + panel_height - panel_height * min(max(py, 0.0), panel.y_max) / (panel.y_max or 1)
                if prev is not None:
                    canvas.line(prev[0], prev[1], sx, sy, colour, thick=2)
                prev = (sx, sy)
    bottom = top_pad + len(panels) * (panel_height + gap) - gap + 28
    for k in range(0, 6):
        t = x_max * k / 5
        canvas.text(int(left + plot_w * k / 5) - 12, bottom, f"{t:.0f}S", scale=2)
    path.write_bytes(canvas.png())
    return path


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.2g}"
