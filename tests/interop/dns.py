#!/usr/bin/env python3
"""A tiny authoritative DNS server for the federation interop run, on loopback only.

It answers A and SRV questions for the test names given on the command line and REFUSES
everything else, so no query ever leaves the machine and no real name resolves through it.

usage: dns.py PORT NAME=IP ... SRV:_service._tcp.NAME=TARGET:PORT ...
"""
import socket
import struct
import sys

A, SRV = 1, 33


def parse_name(data, off):
    labels = []
    while True:
        n = data[off]
        off += 1
        if n == 0:
            return ".".join(labels).lower(), off
        labels.append(data[off:off + n].decode("ascii", "replace"))
        off += n


def encode_name(name):
    out = b""
    for label in name.strip(".").split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\0"


def main():
    port = int(sys.argv[1])
    a_records, srv_records = {}, {}
    for arg in sys.argv[2:]:
        key, value = arg.split("=", 1)
        if key.startswith("SRV:"):
            target, tport = value.rsplit(":", 1)
            srv_records.setdefault(key[4:].lower(), []).append((target, int(tport)))
        else:
            a_records[key.lower()] = value
    zones = set(a_records) | {k.split(".", 2)[2] for k in srv_records}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    print(f"dns: serving {sorted(zones)} on 127.0.0.1:{port}", flush=True)
    while True:
        data, peer = sock.recvfrom(4096)
        if len(data) < 12:
            continue
        qid, flags, qd = struct.unpack(">HHH", data[:6])
        try:
            name, off = parse_name(data, 12)
            qtype, qclass = struct.unpack(">HH", data[off:off + 4])
        except (IndexError, struct.error):
            continue
        question = data[12:off + 4]
        answers = []
        rcode = 0
        in_zone = any(name == z or name.endswith("." + z) for z in zones)
        if not in_zone:
            rcode = 5  # REFUSED: we answer only for the test names
        elif qtype == A and name in a_records:
            rdata = socket.inet_aton(a_records[name])
            answers.append(encode_name(name) + struct.pack(">HHIH", A, 1, 5, len(rdata)) + rdata)
        elif qtype == SRV and name in srv_records:
            for target, tport in srv_records[name]:
                rdata = struct.pack(">HHH", 0, 0, tport) + encode_name(target)
                answers.append(encode_name(name) + struct.pack(">HHIH", SRV, 1, 5, len(rdata)) + rdata)
        elif name not in a_records and not any(name == k for k in srv_records):
            rcode = 3  # NXDOMAIN inside our zones
        print(f"dns: {peer[0]} asks {name} type {qtype} -> rcode {rcode}, {len(answers)} answers", flush=True)
        # QR, AA, RD copied, RA.
        rflags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
        header = struct.pack(">HHHHHH", qid, rflags, 1, len(answers), 0, 0)
        sock.sendto(header + question + b"".join(answers), peer)


if __name__ == "__main__":
    main()
