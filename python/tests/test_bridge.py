"""The SDK's client against a real worker's bridge: run inside a job by in_job.py, by two jobs
of one task at once (they send each other files)."""

import hashlib
import http.server
import os
import shutil
import tempfile
import threading
import unittest

import in_job_context as ctx
from hypha_sdk import BridgeError, safetensors, uri
from hypha_sdk.client import peers


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve_directory(directory: str):
    """An HTTP server on 127.0.0.1 serving ``directory``; returns it and its base URL."""
    handler = lambda *a, **k: _Files(*a, directory=directory, **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@ctx.needs_job
class BridgeEndpoints(unittest.TestCase):
    def setUp(self):
        self.job = ctx.job
        self.bridge = ctx.job.bridge

    def test_a_fetch_downloads_a_url_into_the_job_directory(self):
        directory = tempfile.mkdtemp()
        payload = os.urandom(100_000)
        with open(os.path.join(directory, "weights.bin"), "wb") as file:
            file.write(payload)
        server, base = serve_directory(directory)
        try:
            [entry] = self.bridge.fetch(uri(f"{base}/weights.bin"), out_dir="downloads")
        finally:
            server.shutdown()
            shutil.rmtree(directory)
        self.assertEqual(entry.path, "downloads/weights.bin")
        self.assertEqual(entry.size, len(payload))
        self.assertEqual(entry.checksum, sha256(payload))
        with open(self.job.path(entry.path), "rb") as file:
            self.assertEqual(file.read(), payload)

    def test_a_path_out_of_the_job_directory_is_refused_with_its_code(self):
        with self.assertRaises(BridgeError) as refused:
            self.bridge.fetch(uri("http://127.0.0.1:9/x"), out_dir="../elsewhere")
        self.assertEqual(refused.exception.status, 403)
        self.assertEqual(refused.exception.code, "path_refused")

    def test_a_status_reaches_the_scheduler_and_its_answer_comes_back(self):
        answer = self.bridge.status({"step": 3, "loss": 1.5})
        self.assertEqual(answer, {"received": True, "type": "Ok"})

    def test_openapi_lists_every_endpoint(self):
        document = self.bridge.openapi()
        for path in ("/resources/fetch", "/resources/send", "/resources/receive", "/data/consumed", "/status/send"):
            self.assertIn(path, document["paths"])
        self.assertIn("JobDescription", document["components"]["schemas"])

    def test_the_job_describes_itself_in_both_dialects(self):
        raw = self.job.raw
        self.assertEqual(raw["job_id"], raw["id"])
        self.assertEqual(raw["executor"]["config"], raw["config"])
        self.assertEqual(self.job.executor_class, "test")


@ctx.needs_job
class Slices(unittest.TestCase):
    def test_every_slice_taken_is_read_and_reported_consumed(self):
        bridge, data = ctx.job.bridge, ctx.job.config["data"]
        taken = []
        while True:
            try:
                entry = bridge.next_slice(data, out_dir="slices", wait_ms=2000)
            except BridgeError as error:
                if error.code == "data_wait":
                    continue
                raise
            if entry is None:
                break
            tensors, _ = safetensors.load(ctx.job.path(entry.path))
            self.assertEqual(tensors["inputs"].shape[0], entry.metadata["samples"])
            self.assertEqual(tensors["labels"].shape[0], entry.metadata["samples"])
            slice_id = {"epoch": entry.metadata["epoch"], "slice": entry.metadata["slice"]}
            round_ = len(taken)
            refused = bridge.consumed([slice_id], round_, data, completed_round=round_)
            self.assertEqual(refused, [])
            taken.append(slice_id)
            if len(taken) == 1:
                # Each job takes its first slice before either goes on: on a loaded machine
                # one job could otherwise read the whole dataset while the other still starts.
                ctx.barrier("first-slice", limit=120.0)
        # Both jobs read; each took some, and the Rust test checks the ledger has every slice
        # used once.
        with open(os.path.join(ctx.shared, f"slices-{ctx.me}.txt"), "w") as file:
            file.write(str(len(taken)))
        self.assertGreater(len(taken), 0)


@ctx.needs_job
class Peers(unittest.TestCase):
    def setUp(self):
        self.job = ctx.job
        self.bridge = ctx.job.bridge

    def test_files_go_both_ways_between_the_jobs_of_the_task(self):
        text = f"hello from {ctx.me}".encode()
        with open(self.job.path("mine.txt"), "wb") as file:
            file.write(text)
        received = []
        listening = threading.Thread(
            target=lambda: received.extend(self.bridge.receive([ctx.peer], "One", out_dir="in"))
        )
        listening.start()
        ctx.barrier("listening")
        sent = self.bridge.send("mine.txt", [ctx.peer])
        self.assertEqual(sent.metadata["peers"], [ctx.peer])
        self.assertEqual(sent.checksum, sha256(text))
        listening.join(60)
        self.assertEqual(len(received), 1)
        [file] = received
        self.assertEqual(file.from_peer, ctx.peer)
        self.assertEqual(file.path, f"in/{file.sequence}-mine.txt")
        with open(self.job.path(file.path), "rb") as handle:
            theirs = handle.read()
        self.assertTrue(theirs.startswith(b"hello from ") and theirs != text, theirs)
        ctx.barrier("received")

    def test_a_fetch_of_peers_waits_for_their_file(self):
        with open(self.job.path("second.txt"), "w") as file:
            file.write(f"round two from {ctx.me}")
        ctx.barrier("second")
        self.bridge.send("second.txt", [ctx.peer], strategy="One")
        [entry] = self.bridge.fetch(peers([ctx.peer]), out_dir="in", wait_ms=30_000)
        self.assertTrue(entry.path.endswith("-second.txt"), entry.path)
        with open(self.job.path(entry.path)) as handle:
            self.assertTrue(handle.read().startswith("round two from "))
        ctx.barrier("second-done")

    def test_an_error_event_in_a_stream_is_raised(self):
        # The stream starts into trap/, which then becomes a link out of the job's directory:
        # the file the peer sends cannot be delivered, and the stream says so.
        raised = []

        def listen():
            try:
                for _ in self.bridge.receive([ctx.peer], "One", out_dir="trap"):
                    pass
            except BridgeError as error:
                raised.append(error)

        listening = threading.Thread(target=listen)
        listening.start()
        trap = self.job.path("trap")
        for _ in range(600):
            if os.path.isdir(trap):
                break
            threading.Event().wait(0.05)
        os.rmdir(trap)
        os.symlink(tempfile.gettempdir(), trap)
        ctx.barrier("trapped")
        with open(self.job.path("bait.txt"), "w") as file:
            file.write("bait")
        self.bridge.send("bait.txt", [ctx.peer])
        listening.join(60)
        self.assertEqual(len(raised), 1, "the error event was not raised")
        self.assertEqual(raised[0].code, "path_refused")
        self.assertEqual(raised[0].status, 0, "raised from inside the stream")
        ctx.barrier("trap-done")

    def test_a_receive_refused_before_its_stream_raises(self):
        with self.assertRaises(BridgeError) as refused:
            next(iter(self.bridge.receive(["not-a-peer-id"])))
        self.assertEqual(refused.exception.status, 400)
        self.assertEqual(refused.exception.code, "bad_request")
        self.assertIn("not-a-peer-id", refused.exception.message)


if __name__ == "__main__":
    unittest.main()
