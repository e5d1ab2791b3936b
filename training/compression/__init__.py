"""Gradient compressors for the WAN exchange between cluster leaders.

Build one with `make_compressor(value)` from a compression value of the shared grammar
(`grammar.parse_compression`, forms in `grammar.COMPRESSION_HELP`, runnable examples in
`compressor_specs()`); move its packets with `packet_to_bytes` / `packet_from_bytes`, whose
byte count is what cpn reports as WAN bytes. One compressor per leader (it holds that leader's
residuals); `decompress` reads only the packet, so any instance of the same spec decodes any
leader's packets. Call `step()` once per exchange round, and checkpoint `state_dict()`.
"""

from training.compression.base import Compressor, Packet
from training.compression.serialize import packet_from_bytes, packet_to_bytes
from training.compression.spec import compressor_specs, make_compressor

__all__ = [
    "Compressor",
    "Packet",
    "compressor_specs",
    "make_compressor",
    "packet_from_bytes",
    "packet_to_bytes",
]
