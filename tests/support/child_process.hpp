// Test helper (POSIX): runs a function in a forked child process under a time limit, so a test of
// something that would terminate the program, or hang it, fails instead of taking the suite down.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace gradavg_test {

/// How a child process ended.
struct child_end {
  bool exited = false;  ///< exited normally (else killed by signal)
  int code = -1;        ///< exit code, when exited
  int signal = 0;       ///< the signal that ended it, when not exited

  [[nodiscard]] bool ok() const { return exited && code == 0; }
  [[nodiscard]] std::string describe() const {
    if (exited) return "exited with code " + std::to_string(code);
    return "killed by signal " + std::to_string(signal) + (signal == SIGALRM ? " (SIGALRM: time limit, a hang)" : "") +
           (signal == SIGABRT ? " (SIGABRT: std::terminate)" : "");
  }
};

/// Runs body() (returning an exit code) in a child process killed by SIGALRM after `seconds`.
/// An exception escaping body() exits with code 99. Call it while this process runs one thread.
template <class Body>
child_end run_in_child(unsigned seconds, Body&& body) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(seconds);
    int code = 99;
    try {
      code = body();
    } catch (...) {
    }
    std::_Exit(code);  // no exit handlers, no test report from the child
  }
  child_end end;
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return end;
  if (WIFEXITED(status)) {
    end.exited = true;
    end.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    end.signal = WTERMSIG(status);
  }
  return end;
}

/// How many threads this process runs now (Linux: /proc/self/task).
inline std::size_t threads_in_this_process() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

/// This process's address space now, in bytes (Linux: /proc/self/statm), 0 if unknown.
inline std::size_t address_space_in_use() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long pages = 0;
  const int read = std::fscanf(f, "%lu", &pages);
  std::fclose(f);
  return read == 1 ? pages * static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) : 0;
}

/// Caps this process's address space (RLIMIT_AS), which makes thread stacks fail to map even for
/// root (who is exempt from RLIMIT_NPROC). False if it could not be set.
inline bool limit_address_space(std::size_t bytes) {
  const rlimit limit{bytes, bytes};
  return setrlimit(RLIMIT_AS, &limit) == 0;
}

}  // namespace gradavg_test
