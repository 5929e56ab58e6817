"""The stdlib PNG chart: a valid PNG of the promised size, with the lines drawn."""

import struct
import zlib

from pipeline.sim.chart import Panel, render


def test_chart_is_a_valid_png_with_coloured_lines(tmp_path):
    panels = [Panel("goodput", {"a": [(0, 0), (10, 5)], "b": [(0, 5), (10, 0)]}, 5.0),
              Panel("kv", {"a": [(0, 0.5)], "b": [(0, 1.0)]}, 1.0)]
    data = render(tmp_path / "c.png", "title × 2", panels, 10.0, width=400, panel_height=100).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 400 and height == 70 + 2 * 160 + 30
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    pixels = zlib.decompress(idat)
    assert len(pixels) == height * (1 + 3 * width)
    assert bytes((200, 60, 50)) in pixels and bytes((230, 150, 20)) in pixels, "both series drawn"
