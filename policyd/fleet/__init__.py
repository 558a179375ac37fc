"""A fleet of replicas on NATS JetStream (docs/FLEET.md).

* ``deltas`` - what a daemon's online models learnt, in mergeable form (transition counts,
  stack-distance histogram increments), and merging another replica's into them;
* ``link`` - the daemon's JetStream link: publishes its deltas, applies every other replica's
  exactly once (by stream sequence), keeps deciding locally while NATS is away;
* ``residency`` - a daemon's block residency as compact updates for the routing index;
* ``routing`` - which replica holds a workflow's prefix (the index and the routers, pure);
* ``router_service`` - ``policyd route``: the index fed over NATS, answering over HTTP.
"""
