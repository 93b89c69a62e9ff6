"""The client front end (docs/ARCHITECTURE.md): the handles an application
holds — :mod:`.producer`, :mod:`.consumer`, :mod:`.transaction`,
:mod:`.transactional_producer` and :mod:`.half_producer`. They reach
partitions and subscriptions through the broker that made them and never
import it."""
