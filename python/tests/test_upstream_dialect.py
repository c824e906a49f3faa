"""The upstream Hypha project's Python client, as its accelerate executor drives the bridge.

The request bodies and the ways answers are read are those of that client (``Session`` in
``executors/accelerate/src/hypha/accelerate_executor/api.py`` and its ``training.py``),
written out here: the bare reference as a fetch body, ``resource``/``path``, strategies as
objects, ``response["type"]``, ``[0]["path"]``, and an event-stream parser that keeps only
``data:`` lines. No SDK code is used to speak to the bridge.
"""

import http.client
import json
import os
import shutil
import socket
import tempfile
import threading
import unittest

import in_job_context as ctx
from test_bridge import serve_directory


class _Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("hypha")
        self._path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


def post(path, body, accept=None):
    """Status and body of a POST, as httpx sends it (``json=``)."""
    connection = _Unix(ctx.job.bridge.socket_path)
    headers = {"Content-Type": "application/json"}
    if accept:
        headers["Accept"] = accept
    connection.request("POST", path, body=json.dumps(body), headers=headers)
    response = connection.getresponse()
    return connection, response


def post_json(path, body):
    connection, response = post(path, body)
    try:
        raw = response.read()
        if response.status >= 400:  # raise_for_status()
            raise AssertionError(f"{path} answered {response.status}: {raw!r}")
        return json.loads(raw)
    finally:
        connection.close()


def data_only_events(response):
    """The upstream EventSource: ``json.loads`` of every ``data:`` line, nothing else."""
    while True:
        line = response.readline()
        if not line:
            return
        fieldname, _, value = line.decode().rstrip("\n").partition(":")
        if fieldname == "data":
            yield json.loads(value)


@ctx.needs_job
class UpstreamClient(unittest.TestCase):
    def test_its_job_json_has_job_id_and_executor_config(self):
        job_spec = json.loads(json.dumps(ctx.job.raw))
        executor = job_spec["executor"]
        self.assertEqual(executor["class"], "test")
        self.assertIn("data", executor["config"])
        self.assertEqual(job_spec["job_id"], ctx.job.id)

    def test_its_fetch_posts_a_bare_reference(self):
        directory = tempfile.mkdtemp()
        with open(os.path.join(directory, "config.json"), "w") as file:
            file.write('{"hidden": 8}')
        server, base = serve_directory(directory)
        try:
            answer = post_json("/resources/fetch", {"type": "uri", "value": f"{base}/config.json"})
        finally:
            server.shutdown()
            shutil.rmtree(directory)
        path = answer[0]["path"]
        self.assertEqual(path, "artifacts/config.json")
        with open(ctx.job.path(path)) as file:
            self.assertEqual(file.read(), '{"hidden": 8}')

    def test_its_send_status_reads_the_answers_type(self):
        self.assertEqual(post_json("/status/send", "update-received")["type"], "Ok")
        status = {"status": {"batch_size": 32, "round_time": 12}}
        self.assertEqual(post_json("/status/send", status)["type"], "Ok")
        metrics = {"metrics": {"round": 1, "metrics": {"loss": 0.5}}}
        self.assertEqual(post_json("/status/send", metrics)["type"], "Ok")

    def test_its_send_resource_and_receive_exchange_files(self):
        with open(ctx.job.path("update.txt"), "w") as file:
            file.write(f"update from {ctx.me}")
        events = []

        def receive():
            body = {"resource": {"type": "peers", "peers": [ctx.peer], "strategy": {"type": "All"}}, "path": "incoming"}
            connection, response = post("/resources/receive", body, accept="text/event-stream")
            try:
                for event in data_only_events(response):
                    events.append(event)
                    return  # the stream of All goes on; the client stops reading
            finally:
                connection.close()

        listening = threading.Thread(target=receive)
        listening.start()
        ctx.barrier("upstream-listening")
        request = {"resource": {"type": "peers", "peers": [ctx.peer], "strategy": {"type": "All"}}, "path": "update.txt"}
        post_json("/resources/send", request)
        listening.join(60)
        self.assertEqual(len(events), 1)
        self.assertTrue(events[0]["path"].startswith("incoming/"), events[0])
        with open(ctx.job.path(events[0]["path"])) as file:
            self.assertTrue(file.read().startswith("update from "))
        ctx.barrier("upstream-received")

    def test_a_refused_receive_is_an_event_it_tells_from_a_file(self):
        body = {"resource": {"type": "peers", "peers": ["nobody"]}, "path": "incoming"}
        connection, response = post("/resources/receive", body, accept="text/event-stream")
        try:
            events = list(data_only_events(response))
        finally:
            connection.close()
        self.assertEqual(response.status, 400)
        self.assertEqual(len(events), 1, events)
        self.assertNotIn("path", events[0])
        self.assertEqual(events[0]["error"]["code"], "bad_request")


if __name__ == "__main__":
    unittest.main()
