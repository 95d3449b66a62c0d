package pgcluster

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// tempPrefix names the temporary directories Start creates.
const tempPrefix = "capstan-pg-"

// ownerFile, inside a temporary cluster directory, holds the pid of the
// process that created it, so later runs can tell abandoned directories.
const ownerFile = "owner.pid"

// writeOwner records our pid in dir.
func writeOwner(dir string) error {
	return os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644)
}

// removeAbandoned deletes temporary cluster directories left behind by
// processes that died without calling Stop (for example a test binary that
// panicked; the kernel then shut the server down, but nobody removed the
// directory). A directory is abandoned when the pid in its owner file and the
// pid in its data/postmaster.pid (if any) are both gone. Directories without
// an owner file are left alone. Failures are only logged.
func removeAbandoned(ctx context.Context, log *slog.Logger) {
	dirs, err := filepath.Glob(filepath.Join(os.TempDir(), tempPrefix+"*"))
	if err != nil {
		return
	}
	for _, dir := range dirs {
		owner, ok := readPid(filepath.Join(dir, ownerFile))
		if !ok || alive(owner) {
			continue
		}
		if pm, ok := readPid(filepath.Join(dir, "data", "postmaster.pid")); ok && alive(pm) {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			log.DebugContext(ctx, "pgcluster: cannot remove abandoned cluster directory", "dir", dir, "err", err)
			continue
		}
		log.InfoContext(ctx, "pgcluster: removed abandoned cluster directory", "dir", dir, "owner_pid", owner)
	}
}

// readPid reads the pid on the first line of path.
func readPid(path string) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	return pid, err == nil && pid > 0
}

// alive reports whether a process with the given pid exists (a recycled pid
// counts as alive, which only delays cleanup).
func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
