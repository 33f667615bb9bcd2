/*
 * test_bootstrap.c - the TCP channel between ranks of different processes,
 * on loopback: four processes (this one is rank 0), a 128-byte broadcast
 * received intact by every rank, a gather of per-rank records filed by rank,
 * a rank 0 whose peers never come timing out with a message, and bad
 * arguments refused.
 */
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../harness/bootstrap.h"
#include "check.h"

/* A port that was free a moment ago. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        return 0;
    close(fd);
    return ntohs(a.sin_port);
}

typedef struct {
    int32_t rank;
    uint32_t sum; /* of the broadcast bytes as received */
} record_t;

static uint32_t sum_of(const unsigned char *b, size_t n) {
    uint32_t s = 0;
    for (size_t i = 0; i < n; i++) s = s * 31 + b[i];
    return s;
}

static int run_rank(int rank, int size, int port, unsigned char *msg, record_t *all) {
    comet_bootstrap_t *bs;
    if (comet_bootstrap_open(&bs, rank, size, "127.0.0.1", port, 10000) != COMET_SUCCESS) return 1;
    int bad = comet_bootstrap_bcast(bs, msg, 128) != COMET_SUCCESS;
    record_t mine = {rank, sum_of(msg, 128)};
    bad |= comet_bootstrap_gather(bs, &mine, sizeof mine, all) != COMET_SUCCESS;
    comet_bootstrap_close(bs);
    return bad;
}

int main(void) {
    const int size = 4, port = free_port();
    CHECK(port > 0, "no free port");
    unsigned char msg[128], want[128];
    for (int i = 0; i < 128; i++) want[i] = (unsigned char)(i * 7 + 3);
    pid_t kids[3];
    for (int r = 1; r < size; r++) {
        kids[r - 1] = fork();
        if (kids[r - 1] == 0) {
            memset(msg, 0, sizeof msg);
            _exit(run_rank(r, size, port, msg, NULL) || memcmp(msg, want, sizeof msg) != 0);
        }
    }
    record_t all[4];
    memcpy(msg, want, sizeof msg);
    CHECK(run_rank(0, size, port, msg, all) == 0, "rank 0: %s", comet_last_error());
    for (int r = 0; r < size; r++)
        CHECK(all[r].rank == r && all[r].sum == sum_of(want, 128), "record of rank %d: rank %d sum %u", r, all[r].rank,
              all[r].sum);
    for (int r = 1; r < size; r++) {
        int status = 1;
        waitpid(kids[r - 1], &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d process failed", r);
    }

    comet_bootstrap_t *bs = NULL;
    comet_status_t st = comet_bootstrap_open(&bs, 0, 2, NULL, free_port(), 200);
    CHECK(st == COMET_ERR_TIMEOUT && bs == NULL && strstr(comet_last_error(), "only 1 of 2 ranks"),
          "lonely rank 0: %s %s", comet_status_string(st), comet_last_error());
    st = comet_bootstrap_open(&bs, 1, 2, "127.0.0.1", free_port(), 200);
    CHECK(st == COMET_ERR_TIMEOUT && strstr(comet_last_error(), "could not reach rank 0"), "no rank 0: %s",
          comet_last_error());
    CHECK(comet_bootstrap_open(&bs, 2, 2, NULL, 1234, 100) == COMET_ERR_INVALID_ARGUMENT, "rank >= size");
    CHECK(comet_bootstrap_open(&bs, 0, 1, NULL, 1234, 100) == COMET_SUCCESS && bs, "a world of one needs no socket");
    comet_bootstrap_close(bs);
    comet_bootstrap_close(NULL);
    return check_summary("test_bootstrap");
}
