// Package version stamps ftkit's binaries and reports the versions of what they run on.
package version

import (
	"runtime"
	"runtime/debug"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/criu"
)

// Version is set at link time by the Makefile (-X github.com/ftkit/ftkit/internal/version.Version=...).
var Version string

// Ftkit returns ftkit's version: the link-time stamp, else the VCS revision Go recorded, else "devel".
func Ftkit() string {
	if Version != "" {
		return Version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				return "devel-" + s.Value[:12]
			}
		}
	}
	return "devel"
}

// Info is everything `ftctl version` reports.
type Info struct {
	Ftkit     string `json:"ftkit"`
	Go        string `json:"go"`
	CRIU      string `json:"criu,omitempty"`
	CRIUPath  string `json:"criu_path,omitempty"`
	CRIUError string `json:"criu_error,omitempty"`
	// CRIUPatchLevel is the extra version of the CRIU binary: criu.PatchLevel when `make setup` built it
	// with ftkit's patches.
	CRIUPatchLevel uint32 `json:"criu_patch_level,omitempty"`
	Kernel         string `json:"kernel"`
}

// Collect gathers the versions; a missing or too old CRIU is reported in CRIUError, not as a failure.
func Collect(criuPath string) Info {
	info := Info{Ftkit: Ftkit(), Go: runtime.Version(), Kernel: KernelRelease()}
	bin, v, err := criu.Require(criuPath)
	info.CRIUPath = bin
	if v != 0 {
		info.CRIU = v.String()
	}
	if err != nil {
		info.CRIUError = err.Error()
		return info
	}
	if level, err := criu.BinaryPatchLevel(bin); err == nil {
		info.CRIUPatchLevel = level
	}
	return info
}

// KernelRelease is uname -r.
func KernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}
