// LD_PRELOAD helper for crash diagnosis on the GPU machine: on SIGSEGV/SIGABRT print the native
// backtrace (module(+offset) form, resolvable with addr2line against the same .so) to stderr.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void te_bt_handler(int sig) {
  void* frames[96];
  int n = backtrace(frames, 96);
  const char msg[] = "\n=== segv_bt: native backtrace ===\n";
  write(2, msg, sizeof(msg) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void te_bt_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = te_bt_handler;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
