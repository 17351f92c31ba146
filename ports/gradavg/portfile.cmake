# Released form: the tagged source from GitHub. SHA512 is set when v${VERSION} is tagged (vcpkg
# prints it when given 0).
# Testing from a checkout (scripts/check-vcpkg-port.sh): with GRADAVG_SOURCE_GIT (a git URL, e.g.
# file:///path/to/clone) and GRADAVG_SOURCE_REF (a full commit SHA) in the environment, the port
# builds that commit instead: what is committed there, not uncommitted edits.
if(DEFINED ENV{GRADAVG_SOURCE_GIT})
    vcpkg_from_git(
        OUT_SOURCE_PATH SOURCE_PATH
        URL "$ENV{GRADAVG_SOURCE_GIT}"
        REF "$ENV{GRADAVG_SOURCE_REF}"
    )
else()
    vcpkg_from_github(
        OUT_SOURCE_PATH SOURCE_PATH
        REPO gradavg/gradavg
        REF "v${VERSION}"
        SHA512 0
        HEAD_REF main
    )
endif()

set(VCPKG_BUILD_TYPE release) # header-only port

vcpkg_cmake_configure(
    SOURCE_PATH "${SOURCE_PATH}"
    OPTIONS
        -DGRADAVG_INSTALL=ON
        -DGRADAVG_BUILD_TESTS=OFF
        -DGRADAVG_BUILD_BENCH=OFF
        -DGRADAVG_BUILD_EXAMPLES=OFF
)

vcpkg_cmake_install()

vcpkg_cmake_config_fixup(CONFIG_PATH share/gradavg/cmake)
vcpkg_fixup_pkgconfig()

# Headers only: nothing under lib/; the license is installed as copyright instead of under doc/.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib" "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/share/doc")

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
