"""`gpuportal`, the operator's command line: deploys, scales, sleeps and watches the
portal through its REST API with a stored token. Django-free on purpose: it runs on an operator's
laptop with nothing of the portal but this package, and only ever speaks HTTP."""
