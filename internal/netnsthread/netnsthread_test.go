package netnsthread_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
)

const roleEnv = "FTKIT_NETNSTHREAD_TEST_ROLE"

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "ip-netns-add-after" {
		if err := ipNetnsAddAfter(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestNamedSurvivesIPNetnsAdd: a namespace CreateNamed made can be deleted by its path after someone ran
// `ip netns add` for the first time since boot. Before CreateNamed made /run/netns a shared mount point of
// its own, that `ip netns add` bind-mounted /run/netns onto itself over the namespace's mount, and deleting
// the namespace failed with "device or resource busy" (two lab hosts of a CI run were left so).
//
// It runs in a child in a mount namespace of its own (private: nothing it mounts reaches the host), where
// /run/netns is first made a plain directory again, as after a boot.
func TestNamedSurvivesIPNetnsAdd(t *testing.T) {
	testenv.RequireKernel(t, "mount and network namespaces")
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("this test runs `ip netns add` (iproute2, which scripts/setup.sh installs): %v", err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), self)
	cmd.Env = append(os.Environ(), roleEnv+"=ip-netns-add-after")
	// Go makes the new mount namespace's mounts private (MS_REC|MS_PRIVATE on /) before exec.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	if cmd.Process != nil {
		// The mounts went with the child's mount namespace; the files are the host's.
		for _, name := range testNames(cmd.Process.Pid) {
			os.Remove(filepath.Join(netnsthread.RunDir, name))
		}
	}
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
}

// testNames are the namespaces the child with pid creates: its own and the one `ip netns add` creates.
func testNames(pid int) [2]string {
	return [2]string{fmt.Sprintf("ftkit-nt-ours-%d", pid), fmt.Sprintf("ftkit-nt-theirs-%d", pid)}
}

// ipNetnsAddAfter is the child of TestNamedSurvivesIPNetnsAdd.
func ipNetnsAddAfter() error {
	// As after a boot: /run/netns a plain directory, in this mount namespace only.
	for {
		err := unix.Unmount(netnsthread.RunDir, unix.MNT_DETACH)
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			break
		}
		if err != nil {
			return fmt.Errorf("unmount %s: %w", netnsthread.RunDir, err)
		}
	}
	names := testNames(os.Getpid())
	ours, theirs := names[0], names[1]
	if err := netnsthread.CreateNamed(ours); err != nil {
		return err
	}
	if out, err := exec.Command("ip", "netns", "add", theirs).CombinedOutput(); err != nil {
		return fmt.Errorf("ip netns add %s: %v: %s", theirs, err, out)
	}
	defer exec.Command("ip", "netns", "delete", theirs).Run()
	if err := netns.DeleteNamed(ours); err != nil {
		return fmt.Errorf("delete namespace %s after `ip netns add %s`: %w", ours, theirs, err)
	}
	return nil
}
