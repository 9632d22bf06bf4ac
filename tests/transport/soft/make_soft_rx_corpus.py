#!/usr/bin/env python3
"""Writes the seed corpus of soft_rx_fuzzer.cc (one valid or boundary frame
sequence per file; the input layout is described in soft_rx_fuzzer.cc).
Run from the repository root: tests/transport/soft/make_soft_rx_corpus.py"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soft_rx_corpus")

HELLO, SEND, SEND_IMM, WRITE, WRITE_IMM, READ_REQ, CMP_SWAP, FETCH_ADD = 1, 2, 3, 4, 5, 6, 7, 8
ACK, NAK, RNR_NAK, READ_RESP, ATOMIC_RESP, DISCONNECT = 16, 17, 18, 19, 20, 21
DRIVEN, RECVS, SRQ = 1, 2, 4


def key(i):  # region i's rkey, resolved by the harness
    return 0xC0B5AE00 | i


def addr(i, off=0):  # region i's base + off, resolved by the harness
    return ((0xADD00000 | i) << 32) | (off & 0xFFFFFFFF)


def frame(op, payload=b"", seq=0, a=0, rkey=0, imm=0, dma_len=0, qpn=0,
          flags=0, syndrome=0, payload_len=None):
    n = len(payload) if payload_len is None else payload_len
    return struct.pack("<BBBBIQQIIII", op, flags, syndrome, 0, n, seq, a,
                       rkey, imm, dma_len, qpn) + payload


def atomic_req(compare_add, swap=0):
    return struct.pack("<QQ", compare_add, swap)


SEEDS = {
    # Responder: every request opcode, valid and refused.
    "send": (RECVS, frame(SEND, b"x" * 32)),
    "send_imm_solicited": (RECVS, frame(SEND_IMM, b"y" * 100, imm=7, flags=1)),
    "send_two_sges": (RECVS, frame(SEND, b"z" * 228)),
    "send_too_long": (RECVS, frame(SEND, b"w" * 300)),
    "send_empty": (RECVS, frame(SEND)),
    "send_rnr_then_resend": (0, frame(SEND, b"a" * 8) + frame(SEND, b"a" * 8)),
    "send_huge_length": (RECVS, frame(SEND, b"", payload_len=0xFFFFFFFF)),
    "send_srq": (RECVS | SRQ, frame(SEND, b"s" * 64) + frame(SEND, b"t" * 64, seq=1)),
    "send_driven": (RECVS | DRIVEN, frame(SEND, b"d" * 64) + frame(SEND_IMM, b"e", seq=1)),
    "write": (0, frame(WRITE, b"W" * 64, a=addr(0, 128), rkey=key(0))),
    "write_direct": (0, frame(WRITE, b"D" * 4096, a=addr(0), rkey=key(0))),
    "write_imm": (RECVS, frame(WRITE_IMM, b"I" * 16, a=addr(0), rkey=key(0), imm=9)),
    "write_imm_no_recv": (0, frame(WRITE_IMM, b"I" * 16, a=addr(0), rkey=key(0))),
    "write_zero_length": (0, frame(WRITE, a=0, rkey=0)),
    "write_rkey_zero": (0, frame(WRITE, b"0" * 16, a=addr(0), rkey=0)),
    "write_random_key": (0, frame(WRITE, b"r" * 16, a=addr(0), rkey=0x12345678)),
    "write_stale_key": (0, frame(WRITE, b"s" * 16, a=addr(2), rkey=key(2))),
    "write_read_only": (0, frame(WRITE, b"o" * 16, a=addr(1), rkey=key(1))),
    "write_other_pd": (0, frame(WRITE, b"p" * 16, a=addr(3), rkey=key(3))),
    "write_local_only": (0, frame(WRITE, b"l" * 16, a=addr(4), rkey=key(4))),
    "write_past_end": (0, frame(WRITE, b"e" * 16, a=addr(0, 4090), rkey=key(0))),
    "write_before_start": (0, frame(WRITE, b"b" * 16, a=addr(0, -8), rkey=key(0))),
    "write_wrapping": (0, frame(WRITE, b"w" * 32, a=0xFFFFFFFFFFFFFFF0, rkey=key(0))),
    "write_driven": (DRIVEN, frame(WRITE, b"W" * 5000, a=addr(0), rkey=key(0))),
    "read": (0, frame(READ_REQ, a=addr(0, 64), rkey=key(0), dma_len=128)),
    "read_read_only": (0, frame(READ_REQ, a=addr(1), rkey=key(1), dma_len=4096)),
    "read_zero": (0, frame(READ_REQ, rkey=0, dma_len=0)),
    "read_rkey_zero": (0, frame(READ_REQ, a=addr(0), rkey=0, dma_len=8)),
    "read_stale_key": (0, frame(READ_REQ, a=addr(2), rkey=key(2), dma_len=8)),
    "read_past_end": (0, frame(READ_REQ, a=addr(0, 4000), rkey=key(0), dma_len=200)),
    "read_wrapping": (0, frame(READ_REQ, a=addr(0, 8), rkey=key(0), dma_len=0xFFFFFFFF)),
    "read_with_payload": (0, frame(READ_REQ, b"x" * 8, a=addr(0), rkey=key(0), dma_len=8)),
    "read_many": (0, b"".join(frame(READ_REQ, seq=i, a=addr(0), rkey=key(0), dma_len=16)
                              for i in range(40))),
    "cmp_swap": (0, frame(CMP_SWAP, atomic_req(0, 5), a=addr(0, 8), rkey=key(0))),
    "fetch_add": (0, frame(FETCH_ADD, atomic_req(3), a=addr(0, 16), rkey=key(0))),
    "atomic_unaligned": (0, frame(FETCH_ADD, atomic_req(3), a=addr(0, 4), rkey=key(0))),
    "atomic_read_only": (0, frame(CMP_SWAP, atomic_req(0, 1), a=addr(1), rkey=key(1))),
    "atomic_short": (0, frame(FETCH_ADD, b"1234", a=addr(0), rkey=key(0))),
    "requests_in_order": (RECVS, frame(SEND, b"m" * 10) +
                          frame(WRITE, b"n" * 20, seq=1, a=addr(0), rkey=key(0)) +
                          frame(READ_REQ, seq=2, a=addr(0), rkey=key(0), dma_len=20) +
                          frame(FETCH_ADD, atomic_req(1), seq=3, a=addr(0), rkey=key(0)) +
                          frame(SEND_IMM, b"o", seq=4)),
    "request_out_of_order": (RECVS, frame(SEND, b"q", seq=5)),
    # Requester: responses to the five requests the QP posted.
    "ack_all": (0, frame(ACK, seq=1)),
    "ack_unsent": (0, frame(ACK, seq=100)),
    "nak": (0, frame(NAK, seq=0, syndrome=10)),
    "nak_odd_status": (0, frame(NAK, seq=0, syndrome=200)),
    "rnr_nak": (0, frame(RNR_NAK, seq=0, syndrome=1)),
    "responses": (0, frame(ACK, seq=1) + frame(READ_RESP, b"R" * 64, seq=2) +
                  frame(ATOMIC_RESP, struct.pack("<Q", 42), seq=3) +
                  frame(ATOMIC_RESP, struct.pack("<Q", 43), seq=4)),
    "responses_driven": (DRIVEN, frame(ACK, seq=1) + frame(READ_RESP, b"R" * 64, seq=2) +
                         frame(ATOMIC_RESP, struct.pack("<Q", 42), seq=3)),
    "read_resp_wrong_length": (0, frame(ACK, seq=1) + frame(READ_RESP, b"R" * 65, seq=2)),
    "read_resp_not_outstanding": (0, frame(READ_RESP, b"R" * 64, seq=2)),
    "atomic_resp_for_read": (0, frame(ACK, seq=1) + frame(ATOMIC_RESP, b"8" * 8, seq=2)),
    # Either direction and garbage.
    "disconnect": (0, frame(DISCONNECT)),
    "second_hello": (0, frame(HELLO, a=0x544F46534256434F, dma_len=1)),
    "opcode_zero": (0, frame(0)),
    "opcode_unknown": (0, frame(9, b"??")),
    "opcode_high": (0, frame(255)),
    "partial_header": (0, frame(SEND)[:17]),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for i, (name, (mode, stream)) in enumerate(sorted(SEEDS.items())):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(bytes([mode, (i * 37) & 0xFF]) + stream)


if __name__ == "__main__":
    main()
