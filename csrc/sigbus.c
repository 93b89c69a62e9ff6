/* SIGBUS safety for txmq's file mappings: see sigbus.h. */
#define _GNU_SOURCE
#include "sigbus.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A fixed table: the handler reads it without a lock while the (GIL
 * holding) owner of the mappings adds and clears entries. An entry is
 * published by storing its base last and retired by clearing its base
 * first. */
#define TXMQ_SIGBUS_SLOTS 65536

typedef struct {
    uintptr_t base;
    size_t size;
    int faults;
} txmq_region;

static txmq_region regions[TXMQ_SIGBUS_SLOTS];
static int used;                         /* regions[0, used) may be live */
static struct sigaction previous;
static uintptr_t page_mask;
static int no_faults;                    /* what an unprotected mapping points at */

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    uintptr_t addr = (uintptr_t)info->si_addr;
    int n = __atomic_load_n(&used, __ATOMIC_ACQUIRE);
    if (info->si_code > 0) {             /* a fault, not a kill(2) or raise(3) */
        for (int i = 0; i < n; i++) {
            uintptr_t base = __atomic_load_n(&regions[i].base, __ATOMIC_ACQUIRE);
            if (base && addr >= base && addr < base + regions[i].size) {
                void *page = (void *)(addr & page_mask);
                if (mmap(page, page_mask ? (size_t)(~page_mask + 1) : 4096, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
                    __atomic_add_fetch(&regions[i].faults, 1, __ATOMIC_RELEASE);
                    return;
                }
                break;
            }
        }
    }
    if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
        previous.sa_sigaction(sig, info, context);
        return;
    }
    if (previous.sa_handler == SIG_IGN)
        return;
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != NULL) {
        previous.sa_handler(sig);
        return;
    }
    /* Not ours and no one else's: the access runs again and kills the
     * process, as it would have without this handler. */
    signal(sig, SIG_DFL);
}

int txmq_sigbus_install(void) {
    struct sigaction now, mine;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)
        return 0;
    page_mask = ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    return sigaction(SIGBUS, &mine, &previous);
}

int txmq_sigbus_register(void *base, size_t size, int **faults) {
    int i = 0;
    while (i < used && __atomic_load_n(&regions[i].base, __ATOMIC_RELAXED) != 0)
        i++;
    if (i == TXMQ_SIGBUS_SLOTS) {
        *faults = &no_faults;
        return -1;
    }
    regions[i].size = size;
    __atomic_store_n(&regions[i].faults, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&regions[i].base, (uintptr_t)base, __ATOMIC_RELEASE);
    if (i == used)
        __atomic_store_n(&used, i + 1, __ATOMIC_RELEASE);
    *faults = &regions[i].faults;
    return i;
}

void txmq_sigbus_unregister(int slot) {
    if (slot >= 0 && slot < TXMQ_SIGBUS_SLOTS)
        __atomic_store_n(&regions[slot].base, 0, __ATOMIC_RELEASE);
}
