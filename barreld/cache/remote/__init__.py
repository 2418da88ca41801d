"""Remote tiers: object stores on other hosts, shared by several daemons and trusted for nothing.

`settings` is plain Python (the config reads it before anything heavy is imported); `redis` holds the store
and imports the client.
"""
