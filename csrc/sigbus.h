/* SIGBUS safety for txmq's file mappings.
 *
 * A store to or a load from a page of a shared file mapping that lies past
 * the end of its file (another process truncated it), or whose block the
 * file system cannot allocate (a full tmpfs, a full disk under a sparse
 * file), raises SIGBUS, which by default kills the process. txmq registers
 * every mapping it makes here; a SIGBUS whose address lies in one has its
 * page replaced by a private zero page and is counted on the mapping, and
 * the faulting access goes on, reading zeros. The code that touched the
 * mapping checks the count after each access and raises a typed error:
 * zeros are never handed out as data. A SIGBUS anywhere else goes to the
 * handler that was installed before (or kills the process, as it would
 * have).
 *
 * The scheme is Java's for MappedByteBuffer (the JVM turns such a fault in
 * an unsafe access into an InternalError) done with the page replacement
 * that libsigsegv-style handlers use; SQLite and LMDB instead trust no
 * other process to truncate their files. */
#ifndef TXMQ_SIGBUS_H
#define TXMQ_SIGBUS_H

#include <stddef.h>

/* Install the handler (again, if another one replaced it); 0 or -1. */
int txmq_sigbus_install(void);
/* Register [base, base + size): returns a slot (-1 when the table is full:
 * the mapping is then unprotected) and points *faults at its fault count. */
int txmq_sigbus_register(void *base, size_t size, int **faults);
/* Forget slot ``slot`` (before the mapping is unmapped). */
void txmq_sigbus_unregister(int slot);

static inline int txmq_sigbus_count(const int *faults) {
    return __atomic_load_n(faults, __ATOMIC_ACQUIRE);
}

#endif
