/* The guest's deterministic data: `hr-gen SEED BYTES` writes BYTES bytes of the xorshift64
 * stream started at 2 × SEED + 1 to stdout (every seed its own stream). The guest test's
 * phase 1 writes its files with it and phase 2 regenerates them to compare, so a verified
 * file is checked against its definition, not only against a checksum list stored on the disk
 * under test. Built statically by scripts/build-guest (busybox has no seedable generator, and
 * one in shell is far too slow under TCG). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        static const char usage[] = "usage: hr-gen SEED BYTES\n";
        (void)!write(2, usage, sizeof usage - 1);
        return 2;
    }
    uint64_t state = strtoull(argv[1], NULL, 0) * 2 + 1; /* odd: xorshift never leaves 0 */
    unsigned long long left_bytes = strtoull(argv[2], NULL, 0);
    static unsigned char buffer[1 << 16];
    while (left_bytes > 0) {
        size_t chunk_bytes = left_bytes < sizeof buffer ? (size_t)left_bytes : sizeof buffer;
        for (size_t at = 0; at < chunk_bytes; at += 8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            unsigned char word[8];
            for (int i = 0; i < 8; i++) word[i] = (unsigned char)(state >> (8 * i));
            size_t take = chunk_bytes - at < 8 ? chunk_bytes - at : 8;
            memcpy(buffer + at, word, take);
        }
        for (size_t done = 0; done < chunk_bytes;) {
            ssize_t n = write(1, buffer + done, chunk_bytes - done);
            if (n <= 0) return 1;
            done += (size_t)n;
        }
        left_bytes -= chunk_bytes;
    }
    return 0;
}
