package pgcluster

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

// binaries holds the absolute paths of the PostgreSQL programs we run.
type binaries struct {
	initdb   string
	pgCtl    string
	postgres string
}

// fallbackGlob is where Debian/Ubuntu install versioned server binaries
// that are not on PATH.
const fallbackGlob = "/usr/lib/postgresql/*/bin"

// findBinaries locates initdb, pg_ctl and postgres: first on PATH, then in
// the newest /usr/lib/postgresql/<version>/bin that holds all three.
func findBinaries() (binaries, error) {
	names := []string{"initdb", "pg_ctl", "postgres"}
	found := make([]string, len(names))
	onPath := true
	for i, n := range names {
		p, err := exec.LookPath(n)
		if err != nil {
			onPath = false
			break
		}
		found[i] = p
	}
	if onPath {
		return binaries{initdb: found[0], pgCtl: found[1], postgres: found[2]}, nil
	}

	dirs, _ := filepath.Glob(fallbackGlob) // the pattern is constant and valid
	sort.Slice(dirs, func(i, j int) bool { return pgVersion(dirs[i]) > pgVersion(dirs[j]) })
	for _, d := range dirs {
		ok := true
		for i, n := range names {
			p := filepath.Join(d, n)
			if st, err := os.Stat(p); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
				ok = false
				break
			}
			found[i] = p
		}
		if ok {
			return binaries{initdb: found[0], pgCtl: found[1], postgres: found[2]}, nil
		}
	}
	return binaries{}, fmt.Errorf("pgcluster: initdb, pg_ctl and postgres not found on PATH or in %s: %w", fallbackGlob, exec.ErrNotFound)
}

// pgVersion extracts the major version from /usr/lib/postgresql/<v>/bin,
// returning 0 when it is not a number.
func pgVersion(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

// osUser is the identity PostgreSQL programs run as. A nil *osUser means
// "run as the current user" (we are not root).
type osUser struct {
	name string
	uid  uint32
	gid  uint32
}

// serverUser returns the OS user to run PostgreSQL as: nil when we are not
// root, otherwise the "postgres" user, since initdb and postgres refuse to
// run as root.
func serverUser() (*osUser, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: running as root, so PostgreSQL must run as OS user %q: %w", "postgres", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: parse uid %q of user postgres: %w", u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: parse gid %q of user postgres: %w", u.Gid, err)
	}
	return &osUser{name: u.Username, uid: uint32(uid), gid: uint32(gid)}, nil
}

// sysProcAttr returns the process attributes that run a command as u (nil
// means as ourselves). pdeath, when non-zero, is delivered to the child if
// we die, so a crashed test binary does not leave a server behind.
func (u *osUser) sysProcAttr(pdeath syscall.Signal) *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{Pdeathsig: pdeath}
	if u != nil {
		attr.Credential = &syscall.Credential{Uid: u.uid, Gid: u.gid}
	}
	return attr
}

// chown gives path to u; a nil u is a no-op.
func (u *osUser) chown(path string) error {
	if u == nil {
		return nil
	}
	if err := os.Chown(path, int(u.uid), int(u.gid)); err != nil {
		return fmt.Errorf("pgcluster: chown %s to postgres: %w", path, err)
	}
	return nil
}

// checkTraversable reports an error naming the first ancestor of dir that u
// cannot search (execute), which would make initdb and postgres fail with a
// less helpful "permission denied". A nil u is always fine.
func (u *osUser) checkTraversable(dir string) error {
	if u == nil {
		return nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("pgcluster: absolute path of %s: %w", dir, err)
	}
	for p := abs; ; p = filepath.Dir(p) {
		st, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("pgcluster: stat %s: %w", p, err)
		}
		if !u.canSearch(st) {
			return fmt.Errorf("pgcluster: directory %s (mode %v) is not traversable by OS user %s; "+
				"use a directory whose ancestors are world-searchable (e.g. under os.TempDir(), not t.TempDir()): %w",
				p, st.Mode().Perm(), u.name, os.ErrPermission)
		}
		if p == filepath.Dir(p) {
			return nil
		}
	}
}

// canSearch reports whether u may traverse the directory described by st.
func (u *osUser) canSearch(st os.FileInfo) bool {
	perm := st.Mode().Perm()
	if perm&0o001 != 0 {
		return true
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return true // cannot tell; let the server report it
	}
	if sys.Uid == u.uid {
		return perm&0o100 != 0
	}
	if sys.Gid == u.gid {
		return perm&0o010 != 0
	}
	return false
}

// tailFrom returns at most the last n bytes of the file at path that lie
// after offset off, starting at a line boundary, for error messages. Errors
// yield a placeholder.
func tailFrom(path string, off, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(no server log: %v)", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Sprintf("(server log unreadable: %v)", err)
	}
	start := max(st.Size()-n, off, 0)
	buf := make([]byte, max(st.Size()-start, 0))
	if _, err := f.ReadAt(buf, start); err != nil {
		return fmt.Sprintf("(server log unreadable: %v)", err)
	}
	s := string(buf)
	if start > off {
		if i := strings.IndexByte(s, '\n'); i >= 0 {
			s = s[i+1:]
		}
	}
	return strings.TrimSpace(s)
}
