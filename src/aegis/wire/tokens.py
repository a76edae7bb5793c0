"""Per-pod bootstrap secrets.

A job has one secret, known to its master replicas (the status record) and to the platform that
starts its pods; each pod is handed only its own secret, derived from the job's with HMAC-SHA256
over the pod's full name. The master recomputes it to check a credentials request, so the
request field keeps its name (``bootstrap_token``) and nothing per pod has to be stored. A pod's
secret reveals neither the job's secret nor another pod's, and the job's secret itself is
refused as a pod's: whoever holds one pod's secret can speak for that pod only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

_DOMAIN = b"aegis-pod-token\0"  # a pod's secret can never pass for another kind of MAC


def pod_token(job_token: str, namespace: str, job: str, pod: str) -> str:
    """The bootstrap secret of ``pod`` (``namespace``/``job``), from the job's secret."""
    name = "\0".join((namespace, job, pod)).encode()
    mac = hmac.new(job_token.encode(), _DOMAIN + name, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
