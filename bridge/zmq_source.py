"""The engine's ZMQ publisher, as vLLM and SGLang run it: a SUB to its events, a DEALER to its replay.

* **Events**: a SUB socket *connects* to the publisher's PUB endpoint (which binds ``tcp://*:P``)
  and subscribes to the topic; each message is ``[topic, seq, payload]`` (``bridge.wire``).
* **Replay**: the publisher's ROUTER socket answers ``[b"", start seq (8 bytes)]`` from a DEALER
  with every batch it still buffers from ``start`` on, as ``[b"", topic, seq, payload]``, then the
  end marker ``[b"", b"", ff×8, b""]``. (A REQ socket would receive only the first batch.)

Frames that do not decode are counted (``garbage``) and skipped, never fatal.
"""

from __future__ import annotations

import logging
import time

import zmq

from bridge.wire import END_SEQ, EngineBatch, WireError, decode_frames, decode_seq

log = logging.getLogger("kvflow.bridge")


class ZmqSource:
    """The SUB and DEALER sockets of one engine publisher (one data-parallel rank)."""

    def __init__(self, events_url: str, replay_url: str | None = None, *, topic: str = "",
                 replay_timeout_s: float = 2.0, hwm: int = 100_000) -> None:
        self.events_url = events_url
        self.replay_url = replay_url
        self.replay_timeout_s = replay_timeout_s
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, hwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        # The SUB reconnects by itself when the publisher comes back (an engine restart binds
        # anew): what was published before it reconnected never arrives, so the bridge is told
        # (take_reconnect) and asks the replay socket.
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._connects = 0
        self._reconnected = False
        self.sub.connect(events_url)
        self.garbage = 0
        self.reconnects = 0
        self.replays = 0
        self.replayed_batches = 0

    def take_reconnect(self) -> bool:
        """True once after the SUB connected again (the publisher went away and came back)."""
        seen, self._reconnected = self._reconnected, False
        return seen

    def _monitor_events(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connects += 1
                if self._connects > 1:
                    self.reconnects += 1
                    self._reconnected = True
                    log.warning("reconnected to %s: the publisher went away and came back", self.events_url)

    def recv(self, timeout_s: float) -> EngineBatch | None:
        """The next batch within ``timeout_s`` (None: none came, or what came was garbage)."""
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if self._monitor in ready:
            self._monitor_events()
        if self.sub not in ready:
            return None
        frames = self.sub.recv_multipart()
        try:
            batch = decode_frames(frames)
        except WireError as exc:
            self.garbage += 1
            log.warning("skipping a message that is not a KV event batch: %s", exc)
            return None
        if "garbage" in batch.skipped:
            self.garbage += 1
            log.warning("batch %d is not a KV event batch: counted, its seq taken", batch.seq)
        return batch

    def replay(self, start: int) -> tuple[list[EngineBatch], bool]:
        """The batches the publisher still holds from ``start``, and whether its end marker came
        (False: no replay endpoint, or it did not answer within ``replay_timeout_s``)."""
        if self.replay_url is None:
            return [], False
        self.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_url)
        out: list[EngineBatch] = []
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000) + 1):
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                try:
                    if len(frames) >= 2 and decode_seq(frames[1]) == END_SEQ:
                        self.replayed_batches += len(out)
                        return out, True
                    out.append(decode_frames(frames))
                except WireError as exc:
                    self.garbage += 1
                    log.warning("skipping a replayed message that is not a batch: %s", exc)
        finally:
            sock.close()
        log.warning("replay from %s (seq %d on) gave no end marker within %.1f s", self.replay_url, start,
                    self.replay_timeout_s)
        self.replayed_batches += len(out)
        return out, False

    def close(self) -> None:
        self.sub.disable_monitor()
        self._monitor.close()
        self.sub.close()
        self.ctx.term()
