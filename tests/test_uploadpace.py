"""Uploads yield to reads, never for long (spoke.uploadpace.UploadPacer): policy without
I/O, fed a clock and whether reads wait."""

from __future__ import annotations

from spokefs.spoke.uploadpace import UploadPacer


def test_no_reads_waiting_sends_at_once() -> None:
    p = UploadPacer()
    assert [p.hold(t, False) for t in (0.0, 0.1, 5.0)] == [0.0, 0.0, 0.0]
    assert p.held_s == 0.0


def test_reads_waiting_hold_a_piece_at_most_most_held() -> None:
    p = UploadPacer(most_held=1.0, step=0.25)
    t, waited = 0.0, []
    while (d := p.hold(t, True)) > 0:
        waited.append(d)
        t += d
    assert t == 1.0 and waited == [0.25] * 4  # then the piece goes
    assert p.hold(t, True) > 0  # and the next one yields again
    assert p.held_s == 1.0


def test_a_hold_ends_when_reads_stop_waiting() -> None:
    p = UploadPacer(most_held=1.0, step=0.1)
    assert p.hold(0.0, True) == 0.1
    assert p.hold(0.3, False) == 0.0
    assert abs(p.held_s - 0.3) < 1e-9
    assert p.hold(0.4, True) == 0.1  # a new hold starts afresh
