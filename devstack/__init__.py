"""`make run`'s local stack (`python -m devstack`) and the redis-server it and the tests start; outside shared/
because neither service imports it."""
