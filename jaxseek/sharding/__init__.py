"""Device mesh, the logical → mesh sharding rules, and the parallel schedules built on them."""
