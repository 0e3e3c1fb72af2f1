"""What the operator renders for maru-router and maru-router serves."""

from __future__ import annotations

# maru-router's gauge of client requests being served: the preStop drain hook the operator renders into the
# router pod waits for it to reach 0.
IN_PROGRESS_METRIC = "maru_router_requests_in_progress"
