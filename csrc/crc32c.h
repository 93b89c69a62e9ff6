/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by
 * iSCSI, ext4, Kafka record batches and every txmq on-disk format.
 * txmq_crc32c_update() takes and returns the *finalised* CRC, so
 * crc(a + b) == txmq_crc32c_update(txmq_crc32c_update(0, a), b). */
#ifndef TXMQ_CRC32C_H
#define TXMQ_CRC32C_H

#include <stddef.h>
#include <stdint.h>

uint32_t txmq_crc32c_update(uint32_t crc, const void *data, size_t len);
/* The table-driven path, exposed so tests can check it on any CPU. */
uint32_t txmq_crc32c_software(uint32_t crc, const void *data, size_t len);
/* 1 when the SSE4.2 (x86-64) or CRC (AArch64) instruction is used. */
int txmq_crc32c_hardware(void);

#endif
