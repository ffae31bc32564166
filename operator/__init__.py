"""The Cephalo Kubernetes operator: `kopf run -m cephalo.operator`.

Importing the package registers the kopf handlers (that is how `kopf run -m` finds them);
the pure builders live in `cephalo.operator.render` and `cephalo.operator.discovery`.
"""

from cephalo.operator import handlers as handlers
