package labcluster

// The kernel objects a lab's agents use, for the tests that check Down removes them.
var (
	CgroupDir = cgroupDir
	PinDir    = pinDir
)
