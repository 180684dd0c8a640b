//go:build linux

package streamtest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"

	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/lab"
)

// Child is a running re-executed binary (see ChildMain).
type Child struct {
	Role   string
	Stdin  io.WriteCloser      // roles that wait for a go-ahead read lines from it
	Stderr *testenv.SyncBuffer // everything the child wrote to stderr

	cmd      *exec.Cmd
	lines    chan string
	done     chan struct{} // closed by Stop: the stdout reader stops delivering
	stopOnce sync.Once
	waitOnce sync.Once
	waitErr  error
}

// Start starts this binary in role on host of l, born in cg if not nil, with
// env added to this process's environment. The caller must Stop or Wait for
// the child.
func Start(l *lab.Lab, host string, cg *Cgroup, role string, env ...string) (*Child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this binary to start a %s child: %w", role, err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), append(env, RoleEnv+"="+role)...)
	if cg != nil {
		// Born in the cgroup (clone3 CLONE_INTO_CGROUP): its sockets can
		// never be created in another one.
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cg.fd}
	}
	c := &Child{Role: role, Stderr: &testenv.SyncBuffer{}, cmd: cmd, lines: make(chan string, 16), done: make(chan struct{})}
	cmd.Stderr = c.Stderr
	if c.Stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	// A pipe of our own rather than cmd.StdoutPipe: Wait must not close it
	// under the reader while lines are still buffered.
	out, w, err := os.Pipe()
	if err != nil {
		c.Stdin.Close()
		return nil, fmt.Errorf("stdout pipe for a %s child: %w", role, err)
	}
	cmd.Stdout = w
	err = l.Start(host, cmd)
	w.Close()
	if err != nil {
		out.Close()
		c.Stdin.Close()
		return nil, fmt.Errorf("start %s child on %s: %w", role, host, err)
	}
	go func() {
		defer out.Close()
		defer close(c.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case c.lines <- sc.Text():
			case <-c.done:
				return
			}
		}
	}()
	return c, nil
}

// Line waits for the child's next line of output, until ctx is done.
func (c *Child) Line(ctx context.Context) (string, error) {
	select {
	case l, ok := <-c.lines:
		if !ok {
			return "", fmt.Errorf("%s child exited without output; stderr: %s", c.Role, c.Stderr.String())
		}
		return l, nil
	case <-ctx.Done():
		return "", fmt.Errorf("waiting for %s child output: %w; stderr: %s", c.Role, ctx.Err(), c.Stderr.String())
	}
}

// Wait waits for the child to exit; it may be called again, and after Stop.
func (c *Child) Wait() error {
	c.waitOnce.Do(func() { c.waitErr = c.cmd.Wait() })
	return c.waitErr
}

// Stop kills the child if it still runs and reaps it.
func (c *Child) Stop() {
	_ = c.cmd.Process.Kill()
	_ = c.Wait()
	c.stopOnce.Do(func() { close(c.done) })
}

// StartT is Start for a test: it fails the test if the child cannot start,
// and kills and reaps the child at the end of the test, logging its stderr if
// the test failed.
func StartT(t testing.TB, l *lab.Lab, host string, cg *Cgroup, role string, env ...string) *Child {
	t.Helper()
	c, err := Start(l, host, cg, role, env...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Stop()
		if t.Failed() && c.Stderr.Len() > 0 {
			t.Logf("%s child stderr:\n%s", role, c.Stderr.String())
		}
	})
	return c
}

// LineT is Line for a test: it fails the test if no line comes.
func (c *Child) LineT(ctx context.Context, t testing.TB) string {
	t.Helper()
	l, err := c.Line(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return l
}
