"""Kubernetes discovery with the real `kubernetes` client against a FAKE API server.

No Kubernetes API server can run here, so a stdlib HTTP server on loopback answers
`GET /api/v1/nodes` with recorded NodeList pages (trimmed `kubectl get nodes -o json`
output of a GPU cluster running the NVIDIA device plugin and GPU Feature Discovery).
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

from agents.discovery import DiscoveryError
from agents.discovery.k8s import KubernetesSource
from agents.protocol import GpuInventory


def node(
    name,
    *,
    gpus_cap=None,
    gpus_alloc=None,
    product=None,
    memory=None,
    ready=True,
    unschedulable=None,
):
    labels = {"kubernetes.io/hostname": name}
    if product:
        labels["nvidia.com/gpu.product"] = product
    if memory:
        labels["nvidia.com/gpu.memory"] = memory
    cap = {"cpu": "96", "memory": "1056Gi", "pods": "110"}
    alloc = {"cpu": "95500m", "memory": "1040Gi", "pods": "110"}
    if gpus_cap is not None:
        cap["nvidia.com/gpu"] = gpus_cap
    if gpus_alloc is not None:
        alloc["nvidia.com/gpu"] = gpus_alloc
    return {
        "metadata": {"name": name, "labels": labels, "uid": name + "-uid"},
        "spec": {"unschedulable": unschedulable} if unschedulable else {},
        "status": {
            "capacity": cap,
            "allocatable": alloc,
            "conditions": [
                {"type": "MemoryPressure", "status": "False"},
                {"type": "Ready", "status": "True" if ready else "Unknown"},
            ],
        },
    }


PAGE_1 = {
    "kind": "NodeList",
    "apiVersion": "v1",
    "metadata": {"resourceVersion": "9001", "continue": "page-2"},
    "items": [
        node(
            "a100-1", gpus_cap="8", gpus_alloc="8", product="NVIDIA-A100-SXM4-80GB", memory="81920"
        ),
        node(
            "a100-2",
            gpus_cap="8",
            gpus_alloc="8",
            product="NVIDIA-A100-SXM4-80GB",
            memory="81920",
            unschedulable=True,
        ),
        node("cpu-1"),
    ],
}
PAGE_2 = {
    "kind": "NodeList",
    "apiVersion": "v1",
    "metadata": {"resourceVersion": "9001"},
    "items": [
        node(
            "h100-1", gpus_cap="8", gpus_alloc="7", product="NVIDIA-H100-80GB-HBM3", memory="81559"
        ),
        node(
            "h100-2",
            gpus_cap="8",
            gpus_alloc="8",
            product="NVIDIA-H100-80GB-HBM3",
            memory="81559",
            ready=False,
        ),
        node("mystery-1", gpus_cap="2", gpus_alloc="2"),
    ],
}


class FakeApiServer:
    def __init__(self, status: int = 200):
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.requests.append(self.path)
                url = urlsplit(self.path)
                if status != 200:
                    body = json.dumps(
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "reason": "Forbidden",
                            "code": status,
                        }
                    ).encode()
                elif url.path == "/api/v1/nodes":
                    page = parse_qs(url.query).get("continue", [""])[0]
                    body = json.dumps(PAGE_2 if page == "page-2" else PAGE_1).encode()
                else:
                    body, status_ = b"{}", 404
                    self.send_response(status_)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def api_client(self):
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.port}"
        return client.ApiClient(cfg)


@pytest.fixture
def api_server():
    servers = []

    def start(status=200):
        s = FakeApiServer(status)
        s.thread.start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.httpd.shutdown()
        s.httpd.server_close()


def test_groups_nodes_by_product_and_counts_only_usable_gpus(api_server):
    server = api_server()
    src = KubernetesSource.connect(server.api_client, in_pod=True)
    gpus = src.collect()
    src.close()
    assert gpus == [
        # a100-2 is cordoned: present, not allocatable.
        GpuInventory(model="NVIDIA-A100-SXM4-80GB", memory_gib=80.0, count=16, allocatable=8),
        # h100-1 offers 7 of 8; h100-2 is not Ready.
        GpuInventory(model="NVIDIA-H100-80GB-HBM3", memory_gib=79.65, count=16, allocatable=7),
        GpuInventory(model="unknown", memory_gib=0.0, count=2, allocatable=2),
    ]
    # Both pages were read, the second with the continue token of the first.
    assert len(server.requests) == 2
    assert "continue=page-2" in server.requests[1]


def test_forbidden_says_which_permission_is_missing(api_server):
    server = api_server(status=403)
    src = KubernetesSource.connect(server.api_client, in_pod=True)
    with pytest.raises(DiscoveryError, match=r"HTTP 403 .*'list' on nodes"):
        src.collect()


def test_unreachable_api_server_is_a_discovery_error(api_server):
    server = api_server()
    server.httpd.shutdown()
    server.httpd.server_close()
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.port}"
    cfg.retries = 0
    src = KubernetesSource(client.ApiClient(cfg))
    with pytest.raises(DiscoveryError, match="listing nodes failed"):
        src.collect()
